"""The ``multi`` backend: several stores as tiers, e.g. ``cpu_offload`` then ``shared_storage``.

Lookups take the longest prefix any tier holds; loads read each block from the first tier
that has it; saves go to every tier; a failing tier is logged and skipped, never fatal
(a save fails only when every tier failed). ``discard`` and ``close`` reach every tier.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvdi.connectors.store import BlockStore, ReadIntoStore
from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from kvdi.allocator import KVCacheSpec
    from kvdi.settings import KvdiSettings, MultiSettings

Buffer = bytes | bytearray | memoryview

logger = logging.getLogger(__name__)


class TieredStore:
    """A :class:`~kvdi.connectors.store.BlockStore` over named tiers, tried in order."""

    def __init__(self, tiers: Sequence[tuple[str, BlockStore]]) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
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
                offset = 0
                for piece in pieces:
                    piece[:] = src[offset : offset + piece.nbytes]
                    offset += piece.nbytes
            out.append(src.nbytes)
        return out

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> None:
        """Write to every tier; raise the first OSError only if every tier failed."""
        errors: list[OSError] = []
        for name, store in self.tiers:
            try:
                store.put_many(items)
            except OSError as exc:
                errors.append(exc)
                self._failed(name, "write", exc)
        if len(errors) == len(self.tiers):
            raise errors[0]

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


def open_tier(tier: str, layout: KVCacheSpec, settings: KvdiSettings) -> BlockStore:
    """Build one tier's store with that connector's own settings section."""
    try:
        module = importlib.import_module(f"kvdi.connectors.{tier}")
    except ImportError as exc:
        raise ConfigError(f"KVDI_MULTI__TIERS names {tier!r}, which cannot be imported: {exc}") from None
    factory: Any = getattr(module, "open_store", None)
    if factory is None:
        raise ConfigError(f"KVDI_MULTI__TIERS names {tier!r}, which is not a store connector (no open_store)")
    options = getattr(settings, tier, None)
    store = factory(options, layout, settings)
    if not isinstance(store, BlockStore):
        raise TypeError(f"kvdi.connectors.{tier}.open_store returned {type(store).__name__}, not a BlockStore")
    return store


def open_store(options: MultiSettings, layout: KVCacheSpec, settings: KvdiSettings) -> TieredStore:
    """The backend factory named by the ``multi`` spec: each tier in ``options.tiers`` order."""
    tiers: list[tuple[str, BlockStore]] = []
    try:
        for tier in options.tiers:
            tiers.append((tier, open_tier(tier, layout, settings)))
    except BaseException:
        for _name, store in tiers:
            store.close()
        raise
    return TieredStore(tiers)


__all__ = ["TieredStore", "open_store", "open_tier"]
