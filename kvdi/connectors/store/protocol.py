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
``place_many(items)``       place each block's verified payload into its pieces itself   the worker
                            (canonical sections); the worker checks nothing after        verifies
                            (:class:`PlacingStore`)
``prefetch(keys) -> bool``  start reading objects ahead of the loads (several objects   none
                            in flight on a cold medium); True while that pays
                            (:class:`PrefetchStore`)
``hit_source``              class attribute: the kind of tier that serves a hit (vLLM's  ``external_unspecified``
                            ``CacheHitSource``: ``host``, ``disk``, ``p2p``)
                            (:class:`~kvdi.connectors.base.DeclaresHitSource`)
``watch_evictions(evicted)``  call ``evicted(key)`` for each object the store drops on    none
                            its own (LRU, size cap): KV cache events (:class:`EvictingStore`)
``parts()``                 a composite's stores (multi's tiers, a wrapper's backend):   none
                            hit sources, events and health per part (:class:`CompositeStore`)
``health()``                by node label, True while it serves, False while its         none
                            circuit breaker refuses calls (:class:`HealthStore`)
``direct_frame_order()``    the block order it converts without a host copy; told the    the layout's
                            frames' order once (:class:`FrameOrderStore`: canonical)     order
==========================  ==========================================================  ===========

The conformance suite :mod:`kvdi.testing.conformance` checks a store against all of this.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvdi.connectors.base import REMOTE_HIT_SOURCE, ConnectorContext, DeclaresHitSource
from kvdi.connectors.store.framing import Buffer

HIT_SOURCES = ("device", "host", "p2p", "disk", REMOTE_HIT_SOURCE)
"""The values a ``hit_source`` may take: vLLM's ``CacheHitSource`` (``vllm.v1.metrics.cache_hit_source``)."""


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
class PlacingStore(Protocol):
    """Optional capability: place verified blocks into their pieces itself (a store that assembles a block
    from several objects, each checked as it is read: canonical sections), so the worker checks nothing after."""

    def place_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        """Each block's payload (no frame header) placed into its pieces, every byte verified; the payload
        bytes placed per item, None where the block is missing or bad (its pieces then hold no offered bytes)."""
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


@runtime_checkable
class AsyncLoadStore(Protocol):
    """Optional capability: a class attribute saying whether reads are remote or cold (:func:`prefers_async_load`)."""

    prefers_async_load: bool


@runtime_checkable
class SlottedStore(Protocol):
    """Optional capability: how many blocks the store holds at most (a positive int; None or anything else: unknown)."""

    num_slots: int | None


@runtime_checkable
class EvictingStore(Protocol):
    """Optional capability: tell a watcher which objects the store drops on its own (KV cache events)."""

    def watch_evictions(self, evicted: Callable[[bytes], None]) -> None:
        """From now on call ``evicted(key)`` for each object the store evicts on its own (LRU, a size cap).

        Never for :meth:`BlockStore.discard`; called from whichever thread evicts, so ``evicted``
        must be cheap and thread-safe (the vLLM adapter passes a bounded deque's ``append``).
        One watcher: a second call replaces the first.
        """
        ...


@runtime_checkable
class CompositeStore(Protocol):
    """Optional capability: a store made of other stores (multi's tiers, a wrapper over one backend)."""

    def parts(self) -> Sequence[BlockStore]:
        """The stores this one reads from, in the order it tries them; hit sources, KV cache events and
        health are those of the parts (:func:`leaf_stores`)."""
        ...


@runtime_checkable
class HealthStore(Protocol):
    """Optional capability: the health of the medium's circuit breakers (a Prometheus gauge per node)."""

    def health(self) -> Mapping[str, bool]:
        """By node label (a server, a cluster node, a file): True while it serves, False while calls to it are
        refused (its circuit breaker is open). Cheap and never raising: the vLLM adapter asks once per step."""
        ...


@runtime_checkable
class BatchLookupStore(Protocol):
    """Optional capability: the existence checks of several requests in one round trip."""

    def count_prefix_many(self, key_lists: Sequence[Sequence[bytes]]) -> list[int]:
        """:meth:`BlockStore.count_prefix` of each of ``key_lists``, in one call to the medium."""
        ...


@runtime_checkable
class FrameOrderStore(Protocol):
    """A store that converts the frames it gets and fills into its own stored format (canonical sections), so
    their block order need not be the layout's; it names the order it converts without a host copy."""

    def direct_frame_order(self) -> str:
        """The block order whose frames it writes from and reads into as they are (the layout's when no other is
        cheaper); a staged cache converts into it on the device where it can (:data:`~.staged_order.CONVERTED`)."""
        ...

    def use_frame_order(self, order: str) -> None:
        """From now on the frames it gets and fills are in block order ``order`` (told once, at registration)."""
        ...


OPTIONAL_CAPABILITIES: tuple[type, ...] = (
    ReadIntoStore,
    ViewStore,
    PlacingStore,
    PrefetchStore,
    AsyncLoadStore,
    SlottedStore,
    CheckedStore,
    DeclaresHitSource,
    EvictingStore,
    CompositeStore,
    HealthStore,
    BatchLookupStore,
    FrameOrderStore,
)
"""Every optional capability a store may declare, read by :meth:`StoreCapabilities.of` but for two:
:class:`BatchLookupStore` (the background lookups, :mod:`.lookups`) and :class:`FrameOrderStore` (at registration,
:mod:`.staged_order`). ``docs/store-backend.md`` lists the same; a test keeps them equal."""


@dataclass(frozen=True)
class StoreCapabilities:
    """Every optional capability of one store, read once (protocol checks are slow: not per call)."""

    read_into: bool
    prefers_async_load: bool
    num_slots: int | None
    check: Callable[[], str] | None
    prefetch: Callable[[Sequence[bytes]], bool] | None = None
    visit: bool = False
    place: Callable[[Sequence[tuple[bytes, Sequence[memoryview]]]], list[int | None]] | None = None
    hit_source: str = REMOTE_HIT_SOURCE
    watch_evictions: Callable[[Callable[[bytes], None]], None] | None = None
    parts: tuple[BlockStore, ...] = ()
    health: Callable[[], Mapping[str, bool]] | None = None

    @classmethod
    def of(cls, store: object) -> StoreCapabilities:
        """The capabilities ``store`` declares; anything it does not declare takes its default."""
        slots = store.num_slots if isinstance(store, SlottedStore) else None
        return cls(
            read_into=isinstance(store, ReadIntoStore),
            prefers_async_load=prefers_async_load(store),
            num_slots=slots if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 else None,
            check=store.check if isinstance(store, CheckedStore) else None,
            prefetch=store.prefetch if isinstance(store, PrefetchStore) else None,
            visit=isinstance(store, ViewStore),
            place=store.place_many if isinstance(store, PlacingStore) else None,
            hit_source=str(store.hit_source) if isinstance(store, DeclaresHitSource) else REMOTE_HIT_SOURCE,
            watch_evictions=store.watch_evictions if isinstance(store, EvictingStore) else None,
            parts=tuple(p for p in store.parts() if id(p) != id(store)) if isinstance(store, CompositeStore) else (),
            health=store.health if isinstance(store, HealthStore) else None,
        )


def leaf_stores(store: BlockStore) -> list[BlockStore]:
    """The stores that hold blocks: ``store`` itself, or the leaves of its parts (:class:`CompositeStore`)."""
    parts = StoreCapabilities.of(store).parts
    return [leaf for part in parts for leaf in leaf_stores(part)] if parts else [store]


def health_checks(store: object) -> list[Callable[[], Mapping[str, bool]]]:
    """The :meth:`HealthStore.health` of ``store`` and of every store it is made of, found once."""
    caps = StoreCapabilities.of(store)
    own = [caps.health] if caps.health is not None else []
    return own + [check for part in caps.parts for check in health_checks(part)]


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
    return bool(store.prefers_async_load) if isinstance(store, AsyncLoadStore) else False


def written_count(result: object, count: int) -> int:
    """How many of ``count`` objects a ``put_many`` call wrote: its int result, or all of them for None."""
    if result is None:
        return count
    if isinstance(result, bool) or not isinstance(result, int):
        raise TypeError(f"put_many returned {type(result).__name__}, expected an int")
    return max(0, min(result, count))


class StoreView:
    """A view of the worker's store for one load: it forwards the :class:`BlockStore` methods to the store, and a
    view overrides only ``get_many`` (what the load reads, and from where). It declares no optional capability, so a
    load through it reads into host buffers; closing it closes nothing (the store is the worker's)."""

    def __init__(self, store: BlockStore) -> None:
        self._store = store

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        return self._store.get_many(keys)

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        return self._store.count_prefix(keys)

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> int:
        return self._store.put_many(items)

    def discard(self, key: bytes) -> None:
        self._store.discard(key)

    def close(self) -> None:
        """The store is the worker's: closing a view closes nothing."""


__all__ = [
    "HIT_SOURCES",
    "OPTIONAL_CAPABILITIES",
    "AsyncLoadStore",
    "BatchLookupStore",
    "BlockStore",
    "CheckedStore",
    "CompositeStore",
    "EvictingStore",
    "FrameOrderStore",
    "HealthStore",
    "PlacingStore",
    "PrefetchStore",
    "ReadIntoStore",
    "SlottedStore",
    "StoreCapabilities",
    "StoreView",
    "ViewStore",
    "health_checks",
    "leaf_stores",
    "prefers_async_load",
    "require_store",
    "written_count",
]
