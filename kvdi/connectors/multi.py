"""The ``multi`` backend: several stores as tiers, e.g. ``cpu_offload`` then ``shared_storage``.

Tiers are registered store connectors, resolved by the container through its registry
(:func:`kvdi.containers.resolve_tiers`), so an entry-point store connector can be a tier.

Lookups take the longest prefix any tier holds; loads read each block from the first tier
that has it; saves go to every tier; a failing tier is logged and skipped, never fatal
(a save fails only when every tier failed). ``discard`` and ``close`` reach every tier.

Canonical tiers (docs/stored-format.md#tiers): when any tier stores canonical sections
(``format="canonical"``), the whole composite names blocks as the canonical format does (every TP/PP
shape alike, no per-rank keys: :func:`kvdi.integrations.vllm.parallel.canonical_share`). Every tier
that other processes reach must then be canonical too: a shared per-rank tier would hold every
rank's and every shape's frame under one key. A process-local tier (``cpu_offload``) may stay
per-rank: no other rank or shape ever reads it, and its frames carry the rank's share in their
fingerprint. :func:`check_tier_formats` refuses the rest in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvdi.connectors.store import BlockStore, PrefetchStore, ReadIntoStore, prefers_async_load, written_count
from kvdi.connectors.store.blockio import scatter
from kvdi.connectors.store.framing import Buffer
from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from kvdi.layout import KVCacheSpec
    from kvdi.registry import Tier
    from kvdi.settings import KvdiSettings, MultiSettings

logger = logging.getLogger(__name__)


class TieredStore:
    """A :class:`~kvdi.connectors.store.BlockStore` over named tiers, tried in order."""

    def __init__(self, tiers: Sequence[tuple[str, BlockStore]]) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        # Load in the background when any tier is remote or cold: a load may fall through to it.
        self.prefers_async_load = any(prefers_async_load(store) for _, store in self.tiers)
        self.tier_failures: dict[str, int] = {name: 0 for name, _ in self.tiers}

    def _failed(self, name: str, what: str, exc: OSError) -> None:
        if not self.tier_failures[name]:
            logger.warning("multi tier %r: %s failed, using the other tiers: %s (logged once)", name, what, exc)
        self.tier_failures[name] += 1

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        best, errors = 0, 0
        for name, store in self.tiers:
            try:
                best = max(best, store.count_prefix(keys))
            except OSError as exc:
                errors += 1
                self._failed(name, "lookup", exc)
                if errors == len(self.tiers):
                    raise
            if best == len(keys):
                break
        return best

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        out: list[Buffer | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for name, store in self.tiers:
            if not missing:
                break
            try:
                got = store.get_many([keys[i] for i in missing])
            except OSError as exc:
                self._failed(name, "read", exc)
                continue
            for i, obj in zip(missing, got, strict=True):
                out[i] = obj
            missing = [i for i in missing if out[i] is None]
        return out

    def get_into_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        """Each object from the first tier that holds it with the right size (see ``ReadIntoStore``)."""
        out: list[int | None] = [None] * len(items)
        wanted = [sum(p.nbytes for p in pieces) for _, pieces in items]
        pending = list(range(len(items)))
        for name, store in self.tiers:
            if not pending:
                break
            try:
                if isinstance(store, ReadIntoStore):
                    got = store.get_into_many([items[i] for i in pending])
                else:
                    got = self._read_copy(store, [items[i] for i in pending])
            except OSError as exc:
                self._failed(name, "read", exc)
                continue
            for i, size in zip(pending, got, strict=True):
                if size is not None and (out[i] is None or size == wanted[i]):
                    out[i] = size
            pending = [i for i in pending if out[i] != wanted[i]]
        return out

    @staticmethod
    def _read_copy(store: BlockStore, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        out: list[int | None] = []
        for obj, (_key, pieces) in zip(store.get_many([k for k, _ in items]), items, strict=True):
            if obj is None:
                out.append(None)
                continue
            src = memoryview(obj).cast("B")
            if src.nbytes == sum(p.nbytes for p in pieces):
                scatter(src, pieces)
            out.append(src.nbytes)
        return out

    def parts(self) -> list[BlockStore]:
        """:class:`~kvdi.connectors.store.CompositeStore`: the tiers' stores, in order."""
        return [store for _, store in self.tiers]

    def prefetch(self, keys: Sequence[bytes]) -> bool:
        """Read ahead in every tier that can (see ``PrefetchStore``); True while any tier says it pays."""
        more = False
        for _name, store in self.tiers:
            if isinstance(store, PrefetchStore):
                try:
                    more = store.prefetch(keys) or more
                except Exception:  # a hint only
                    continue
        return more

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> int:
        """Write to every tier; return the most objects any tier wrote (the objects now held somewhere).

        A tier that raises counts as having written nothing, and a tier that wrote less than
        all counts as a tier failure; the first OSError is raised only if every tier raised.
        """
        errors: list[OSError] = []
        written = 0
        for name, store in self.tiers:
            try:
                done = written_count(store.put_many(items), len(items))
                if done < len(items):  # stores count their own failures and return what they wrote
                    self._failed(name, "write", OSError(f"wrote {done} of {len(items)} objects"))
                written = max(written, done)
            except OSError as exc:
                errors.append(exc)
                self._failed(name, "write", exc)
        if len(errors) == len(self.tiers):
            raise errors[0]
        return written

    def discard(self, key: bytes) -> None:
        for name, store in self.tiers:
            try:
                store.discard(key)
            except OSError as exc:
                self._failed(name, "discard", exc)

    def close(self) -> None:
        """Close every tier, even if one fails; re-raise the first failure after."""
        first: BaseException | None = None
        for _name, store in self.tiers:
            try:
                store.close()
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first


def tier_format(tier: Tier) -> str:
    """A tier's stored format: its options' ``format`` (``per_rank`` for a store without one)."""
    value = getattr(tier.options, "format", "per_rank")
    return value if isinstance(value, str) else "per_rank"


def check_tier_formats(tiers: Sequence[Tier]) -> None:
    """Refuse, in one line, canonical tiers beside a per-rank tier that other processes reach (module docstring)."""
    canonical = [t.name for t in tiers if tier_format(t) == "canonical"]
    shared = [t.name for t in tiers if tier_format(t) != "canonical" and not t.connector.spec.process_local]
    if canonical and shared:
        names = ", ".join(t.name for t in tiers)
        tier = next(t for t in tiers if t.name == shared[0])
        builtin = isinstance(tier.connector.spec.settings, str) and ":" not in tier.connector.spec.settings
        fix = f"KVDI_{tier.name.upper()}__FORMAT=canonical" if builtin else f"format canonical in {tier.name}'s options"
        raise ConfigError(
            f"KVDI_MULTI__TIERS=({names}): tier {tier.name!r} stores per-rank frames beside canonical tier "
            f"{canonical[0]!r}; with a canonical tier every tier other processes reach must be canonical (set "
            f"{fix}) or be process-local (cpu_offload)"
        )


def open_store(
    options: MultiSettings, layout: KVCacheSpec, settings: KvdiSettings, *, tiers: Sequence[Tier]
) -> TieredStore:
    """The backend factory named by the ``multi`` spec: each resolved tier's store, in order.

    ``tiers`` come from the container (:func:`kvdi.containers.resolve_tiers`); ``options``
    is kept for the backend-factory signature. Raises TypeError if a tier's backend is not
    a BlockStore; tiers opened before a failure are closed. Raises ConfigError for canonical tiers beside
    a shared per-rank one (:func:`check_tier_formats`).
    """
    check_tier_formats(tiers)
    stores: list[tuple[str, BlockStore]] = []
    try:
        for tier in tiers:
            factory = tier.connector.backend_factory
            assert factory is not None  # resolve_store only returns connectors with a backend
            store = factory(tier.options, layout, settings)
            if not isinstance(store, BlockStore):
                close = getattr(store, "close", None)
                if callable(close):
                    close()
                raise TypeError(
                    f"tier {tier.name!r}: {tier.connector.spec.backend} returned "
                    f"{type(store).__name__}, not a BlockStore"
                )
            stores.append((tier.name, store))
    except BaseException:
        for _name, opened in stores:
            opened.close()
        raise
    return TieredStore(stores)


__all__ = ["TieredStore", "check_tier_formats", "open_store", "tier_format"]
