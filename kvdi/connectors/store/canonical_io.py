"""One rank's canonical reads and writes over any :class:`~kvdi.connectors.store.BlockStore`.

:class:`CanonicalRank` writes the sections of :func:`~.canonical.write_plan` (replicated heads by
one rank only) and loads blocks from the sections of :func:`~.canonical.read_plan`: it reads only
those objects (a ``pread`` of each file on shared_storage, one ``GET`` per key on Redis), verifies
each whole section before any byte lands, and loads a block only when every section it needs is
present and valid. Loads stop at the first block that is not: that block and the ones after it
are misses, counted by reason in :attr:`CanonicalRank.misses` (``absent``, ``error``, or a
:data:`~.canonical.REASONS` / ``checksum`` / ``mac`` reason; ``old_format`` for a per-rank frame).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvdi.connectors.store.canonical import (
    HEADER_SIZE,
    Geometry,
    RankPart,
    Section,
    frame_section,
    open_section,
    read_plan,
    write_plan,
)
from kvdi.connectors.store.canonical_convert import ORDERS, pack_section, unpack_section
from kvdi.connectors.store.framing import Buffer, CorruptObjectError, FrameKey

if TYPE_CHECKING:
    import torch

    from kvdi.connectors.store.protocol import BlockStore

Layers = Sequence["Buffer | torch.Tensor"]


class CanonicalRank:
    """A rank of any TP/PP shape reading and writing canonical sections of blocks in ``store``.

    ``order`` is the engine's stored block order (``""``, ``"nhc"``, ``"hnc"``); ``key`` the
    integrity key (``KVDI_INTEGRITY_KEY``) or None. Raises ConfigError when the rank's share is not
    whole sections (:func:`~.canonical.write_plan`).
    """

    def __init__(
        self, store: BlockStore, geometry: Geometry, part: RankPart, order: str = "", key: FrameKey | None = None
    ) -> None:
        if order not in ORDERS:
            raise ValueError(f"order={order!r} is not a stored block order; allowed: {', '.join(map(repr, ORDERS))}")
        self.store = store
        self.geometry = geometry
        self.part = part
        self.order = order
        self.key = key
        self.writes: list[Section] = write_plan(geometry, part)
        self.reads: list[Section] = read_plan(geometry, part)
        self.misses: Counter[str] = Counter()
        self.loaded_blocks = 0
        self.written_bytes = 0
        self.read_bytes = 0

    def object_bytes(self) -> int:
        """The size of every stored section object (uniform: the grid divides the model)."""
        return HEADER_SIZE + self.geometry.section_bytes(self.reads[0])

    def save(self, blocks: Sequence[tuple[bytes, Layers]]) -> int:
        """Write this rank's sections of each ``(block key, per-layer buffers)``; return objects written."""
        items: list[tuple[bytes, Sequence[Buffer]]] = []
        for block_key, layers in blocks:
            for section in self.writes:
                name = section.key(block_key)
                payload = pack_section(self.geometry, self.part, layers, self.order, section)
                items.append((name, [frame_section(self.geometry, section, payload, self.key, name=name), payload]))
        if not items:
            return 0
        written = self.store.put_many(items)
        self.written_bytes += written * self.object_bytes()
        return written

    def count_prefix(self, block_keys: Sequence[bytes]) -> int:
        """Leading blocks with every section this rank needs present (an existence check only)."""
        n = len(block_keys)
        for section in self.reads:
            if n == 0:
                break
            n = min(n, self.store.count_prefix([section.key(k) for k in block_keys[:n]]))
        return n

    def load(self, blocks: Sequence[tuple[bytes, Layers]]) -> int:
        """Load the leading blocks whose needed sections are all present and valid into their (writable)
        per-layer buffers; return how many. The first block that is not, and every one after it, is a miss."""
        fetched = self.fetch_many([key for key, _ in blocks])
        for n, ((_, layers), payloads) in enumerate(zip(blocks, fetched, strict=True)):
            if payloads is None:
                self.misses["blocks"] += len(blocks) - n
                return n
            for section, payload in zip(self.reads, payloads, strict=True):
                unpack_section(self.geometry, self.part, layers, self.order, section, payload)
            self.loaded_blocks += 1
        return len(blocks)

    def fetch_many(self, block_keys: Sequence[bytes]) -> list[list[memoryview] | None]:
        """Every needed section of each block, verified (one store call for all); None for a block where any
        section is absent or bad (its reason counted, a bad object discarded)."""
        per = len(self.reads)
        names = [s.key(k) for k in block_keys for s in self.reads]
        try:
            found = self.store.get_many(names) if names else []
            if len(found) != len(names):
                raise ValueError(f"get_many returned {len(found)} objects for {len(names)} keys")
        except Exception:  # a store call that fails is a miss, never an exception
            self.misses["error"] += 1
            return [None] * len(block_keys)
        return [
            self._check(names[i * per : (i + 1) * per], found[i * per : (i + 1) * per]) for i in range(len(block_keys))
        ]

    def _check(self, names: Sequence[bytes], found: Sequence[Buffer | None]) -> list[memoryview] | None:
        payloads: list[memoryview] = []
        for section, name, buf in zip(self.reads, names, found, strict=True):
            if buf is None or memoryview(buf).nbytes == 0:
                self.misses["absent"] += 1
                return None
            self.read_bytes += memoryview(buf).nbytes
            try:
                payloads.append(open_section(buf, self.geometry, section, self.key, name=name))
            except CorruptObjectError as exc:
                self.misses[exc.reason] += 1
                try:
                    self.store.discard(name)  # never offered again
                except Exception:
                    self.misses["error"] += 1
                return None
        return payloads


__all__ = ["CanonicalRank"]
