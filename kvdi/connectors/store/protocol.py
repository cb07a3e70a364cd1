"""What the store halves need from a backend: the :class:`BlockStore` protocol and its optional capabilities.

A BlockStore holds framed objects (see :mod:`kvdi.connectors.store.framing`) by block key and
knows nothing about tensors. Five methods are required (:class:`BlockStore`). Everything else
is an optional capability, declared here and read in one place (:meth:`StoreCapabilities.of`)
with a default, so a backend that offers none of them works unchanged:

==========================  ==========================================================  ===========
capability                  what it is for                                              default
==========================  ==========================================================  ===========
``get_into_many``           read straight into the cache, no staging copy               get_many
                            (:class:`ReadIntoStore`)
``prefers_async_load``      class attribute: reads are remote or cold, load beside the  False
                            compute (:func:`prefers_async_load`)
``num_slots``               attribute: how many blocks the store holds at most (the     None
                            vLLM adapter sizes its key index with it)
``check()``                 a one-line health summary; raises OSError when the store    none
                            cannot serve (``kvdi check``)
``visit_many(keys, visit)``  lend each object's bytes to ``visit`` (no copy): the worker  get_into_many
                            verifies and copies them while they are in the CPU cache
                            (:class:`ViewStore`)
``prefetch(keys) -> bool``  start reading objects ahead of the loads (several objects   none
                            in flight on a cold medium); True while that pays
                            (:class:`PrefetchStore`)
==========================  ==========================================================  ===========

The conformance suite :mod:`kvdi.testing.conformance` checks a store against all of this.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvdi.connectors.base import ConnectorContext
from kvdi.connectors.store.framing import Buffer


@runtime_checkable
class BlockStore(Protocol):
    """Storage of framed blocks by key. Implementations must be safe to share by both halves of one engine.

    Failures of the medium (disk full, server gone) should raise ``OSError`` (``ConnectionError``,
    ``TimeoutError`` are OSErrors); the halves catch every exception at each call anyway and
    count it, so a misbehaving store is a miss, never a failed request.
    """

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are present without a gap (an existence check only)."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The framed object of each key, or None where absent. One contiguous buffer per key."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> int:
        """Store each ``(key, pieces)``: the object is the concatenation of ``pieces`` (header, payload).

        Publishing is atomic per key: a reader sees the whole object or nothing. Returns how
        many objects were written (a partial batch counts only what was written); a third-party
        store that returns None is taken to have written all of them (:func:`written_count`).
        """
        ...

    def discard(self, key: bytes) -> None:
        """Remove one object (used to drop corrupt or foreign objects); absent keys are fine."""
        ...

    def close(self) -> None:
        """Release handles; called on container shutdown."""
        ...


@runtime_checkable
class ReadIntoStore(Protocol):
    """Optional extra a store may offer: read objects straight into caller buffers (no staging copy).

    The worker half uses it when present and falls back to :meth:`BlockStore.get_many` otherwise.
    """

    def get_into_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        """For each ``(key, pieces)``: the stored object's size, or None if absent.

        When the size equals the total size of ``pieces``, the object has been copied into
        them in order; otherwise ``pieces`` are left untouched.
        """
        ...


@runtime_checkable
class CheckedStore(Protocol):
    """Optional capability: ``check()`` probes the medium and returns a one-line summary (``kvdi check``)."""

    def check(self) -> str:
        """A one-line summary of where the store is and how it is set up; OSError when it cannot serve."""
        ...


@runtime_checkable
class ViewStore(Protocol):
    """Optional capability: lend objects' bytes in place (memory stores), so that a load reads them once."""

    def visit_many(self, keys: Sequence[bytes], visit: Callable[[int, memoryview], None]) -> list[bool]:
        """Call ``visit(i, frame)`` for each present ``keys[i]`` (a view valid during the call); which were present.

        The store must keep the bytes from changing during ``visit`` (e.g. hold its lock) and
        must pass at most one frame of bytes. ``visit`` never raises.
        """
        ...


@runtime_checkable
class PrefetchStore(Protocol):
    """Optional capability: read objects ahead, so that a cold medium has several reads in flight."""

    def prefetch(self, keys: Sequence[bytes]) -> bool:
        """Start fetching ``keys`` (a hint: never raises for a missing or odd object, returns at once).

        Returns True when the objects were not all in fast memory, so prefetching the keys after
        them pays; False when they already were (the worker half then stops asking for this load).
        """
        ...


@dataclass(frozen=True)
class StoreCapabilities:
    """Every optional capability of one store, read once (protocol checks are slow: not per call)."""

    read_into: bool
    prefers_async_load: bool
    num_slots: int | None
    check: Callable[[], str] | None
    prefetch: Callable[[Sequence[bytes]], bool] | None = None
    visit: bool = False

    @classmethod
    def of(cls, store: object) -> StoreCapabilities:
        """The capabilities ``store`` declares; anything it does not declare takes its default."""
        slots = getattr(store, "num_slots", None)
        return cls(
            read_into=isinstance(store, ReadIntoStore),
            prefers_async_load=prefers_async_load(store),
            num_slots=slots if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 else None,
            check=store.check if isinstance(store, CheckedStore) else None,
            prefetch=store.prefetch if isinstance(store, PrefetchStore) else None,
            visit=isinstance(store, ViewStore),
        )


def require_store(context: ConnectorContext) -> BlockStore:
    """The context's backend as a BlockStore, or a TypeError naming the connector."""
    backend = context.backend
    if not isinstance(backend, BlockStore):
        raise TypeError(
            f"connector {context.name!r} needs a BlockStore backend (count_prefix, get_many, put_many, "
            f"discard, close), got {type(backend).__name__}"
        )
    return backend


def prefers_async_load(store: object) -> bool:
    """The store's ``prefers_async_load`` attribute (a class or instance attribute), False when it has none.

    A backend sets it True when its reads are remote or cold (a network round trip, a disk
    that is not in the page cache), so that loading beside the compute beats loading
    before it; a local, warm store leaves it False (a synchronous load there costs less
    than the step of latency an asynchronous one adds).
    """
    return bool(getattr(store, "prefers_async_load", False))


def written_count(result: object, count: int) -> int:
    """How many of ``count`` objects a ``put_many`` call wrote: its int result, or all of them for None."""
    if result is None:
        return count
    if isinstance(result, bool) or not isinstance(result, int):
        raise TypeError(f"put_many returned {type(result).__name__}, expected an int")
    return max(0, min(result, count))


__all__ = [
    "BlockStore",
    "CheckedStore",
    "PrefetchStore",
    "ReadIntoStore",
    "StoreCapabilities",
    "ViewStore",
    "prefers_async_load",
    "require_store",
    "written_count",
]
