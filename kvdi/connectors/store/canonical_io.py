"""One rank's canonical reads and writes over any :class:`~kvdi.connectors.store.BlockStore`.

:class:`CanonicalRank` writes the sections of :func:`~.canonical.write_plan` (replicated heads by
one rank only) as one pack a block and layer section (:mod:`.canonical_pack`), and loads blocks
from the sections of :func:`~.canonical.read_plan`: it finds the packs covering them (the pack
sizes a writer can have, the last one that hit first), reads only its sections' byte range of
each (one bounded range read, :mod:`.canonical_reads`), verifies each section before it is
offered, and loads a block only when every section it needs is present and valid. Loads stop at
the first block that is not: that block and the ones after it are misses, counted by reason in
:attr:`CanonicalRank.misses` (``absent``: no pack size holds them all; ``error``; or a
:data:`~.canonical.REASONS` / ``checksum`` / ``mac`` reason; ``old_format`` for a per-rank frame).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import xxhash

from kvdi.connectors.store.canonical import (
    CHECKED_SIZE,
    HEADER_SIZE,
    Geometry,
    RankPart,
    Section,
    checked_fields,
    frame_section,
    read_plan,
    write_plan,
)
from kvdi.connectors.store.canonical_convert import ORDERS, direct_runs, layer_bytes, pack_block, unpack_block
from kvdi.connectors.store.canonical_pack import Span, frame_bytes, pack_bytes, pack_sizes, spans
from kvdi.connectors.store.canonical_reads import RangeReader
from kvdi.connectors.store.framing import Buffer, FrameKey, name_field

if TYPE_CHECKING:
    import torch

    from kvdi.connectors.store.protocol import BlockStore

Layers = Sequence["Buffer | torch.Tensor"]


class Staging(threading.local):
    """This thread's reusable buffers by purpose (``"save"``, ``"load"``): a save or load packs or reads into
    the same memory each call (no allocation, zeroing or page faults per block; hot in the CPU cache when a
    call is a chunk of about a MiB). A buffer grows to the largest call seen and is then kept."""

    def __init__(self) -> None:
        self.buffers: dict[str, bytearray] = {}

    def get(self, purpose: str, nbytes: int) -> memoryview:
        """``nbytes`` of the ``purpose`` buffer (what an earlier call left there is overwritten by the caller)."""
        buf = self.buffers.get(purpose)
        if buf is None or len(buf) < nbytes:
            buf = self.buffers[purpose] = bytearray(nbytes)
        return memoryview(buf)[:nbytes]


class CanonicalRank(RangeReader):
    """A rank of any TP/PP shape reading and writing canonical sections of blocks in ``store``.

    ``order`` is the engine's stored block order (``""``, ``"nhc"``, ``"hnc"``); ``key`` the
    integrity key (``KVDI_INTEGRITY_KEY``) or None. Raises ConfigError when the rank's share is not
    whole sections (:func:`~.canonical.write_plan`).
    """

    def __init__(
        self, store: BlockStore, geometry: Geometry, part: RankPart, order: str = "", key: FrameKey | None = None
    ) -> None:
        self.writes: list[Section] = write_plan(geometry, part)
        reads = read_plan(geometry, part)
        super().__init__(store, geometry, key, reads)
        self.part = part
        self.packs: list[Span] = spans(geometry, self.writes, part.write_count) if self.writes else []
        """The packs this rank writes of a block (one a layer section), each all of its written sections."""
        self.plans: list[list[Span]] = [spans(geometry, reads, d) for d in pack_sizes(geometry)]
        """Per pack size a writer may have (largest first): the range reads that cover :attr:`reads`."""
        self.loaded_blocks = 0
        self.written_bytes = 0
        self._staging = Staging()
        self._zero_headers = [checked_fields(geometry, s, bytes(16)) for s in self.writes]
        self.reorder(order)

    def direct(self, order: str) -> bool:
        """Whether blocks in ``order`` are written and read as they are (every section one run of each layer)."""
        g, p = self.geometry, self.part
        return direct_runs(g, p, order, self.writes) is not None and direct_runs(g, p, order, self.reads) is not None

    def reorder(self, order: str) -> None:
        """From now on the blocks saved and loaded are in block ``order`` (one of :data:`ORDERS`)."""
        if order not in ORDERS:
            raise ValueError(f"order={order!r} is not a stored block order; allowed: {', '.join(map(repr, ORDERS))}")
        self.order = order
        self.write_runs = direct_runs(self.geometry, self.part, order, self.writes)
        """Each written section's offset in its layers' buffers (its bytes of a layer, one run), or None:
        converted through a staging buffer."""
        self.read_runs = direct_runs(self.geometry, self.part, order, self.reads)
        """The same for the sections read (:meth:`load_direct`)."""
        self._write_cuts = self._cuts(self.writes, self.write_runs)
        self._read_cuts = self._cuts(self.reads, self.read_runs)

    def object_bytes(self) -> int:
        """The bytes of one framed section in a pack (uniform: the grid divides the model)."""
        return frame_bytes(self.geometry)

    def save(self, blocks: Sequence[tuple[bytes, Layers]]) -> int:
        """Write this rank's packs of each ``(block key, per-layer buffers)``; return packs written.

        Where each section's bytes of a layer are one run of it (:attr:`write_runs`) they are framed and
        written as they are, no copy; else packed into this thread's save staging buffer (reused: no
        allocation per call), one strided copy per layer. One checksum pass, one store call."""
        if not self.writes or not blocks:
            return 0
        g = self.geometry
        payloads: Iterable[list[list[memoryview]]]
        if self.write_runs is not None:  # no conversion: each section's bytes of a layer are one run of it
            payloads = [self._runs(layers, self._write_cuts) for _, layers in blocks]
        else:  # each block packed just before it is framed: its checksum reads it while it is in the CPU cache
            payloads = self._packed(blocks)
        items: list[tuple[bytes, Sequence[Buffer]]] = []
        for (block_key, _), sections in zip(blocks, payloads, strict=True):
            for span in self.packs:
                name = span.pack.key(block_key)
                items.append((name, self._framed(span, name, sections)))
        written = self.store.put_many(items)
        self.written_bytes += written * pack_bytes(g, self.packs[0].pack)
        return written

    def _framed(self, span: Span, name: bytes, sections: Sequence[Sequence[Buffer]]) -> list[Buffer]:
        """Pack ``name``'s pieces: each section of ``span`` framed, then its payload pieces. Without an integrity key
        the headers are built in one pass into one buffer, from each section's header made once with the name field
        zero (:attr:`_zero_headers`): the name spliced in, then the checksum (what :func:`frame_section` writes)."""
        first, count = span.first, span.count
        if self.key is not None:
            g = self.geometry
            return [
                x
                for i in range(first, first + count)
                for x in (frame_section(g, self.writes[i], sections[i], self.key, name=name), *sections[i])
            ]
        field = name_field(name)
        headers = bytearray(count * HEADER_SIZE)  # MAC field zero: no key
        view, pieces = memoryview(headers), list[Buffer]()
        for n in range(count):
            zero = self._zero_headers[first + n]
            checked = zero[:24] + field + zero[40:]
            h = xxhash.xxh3_64()
            for piece in sections[first + n]:
                h.update(piece)
            h.update(checked)
            at = n * HEADER_SIZE
            headers[at : at + CHECKED_SIZE] = checked
            headers[at + CHECKED_SIZE : at + CHECKED_SIZE + 8] = h.intdigest().to_bytes(8, "little")
            pieces.append(view[at : at + HEADER_SIZE])
            pieces.extend(sections[first + n])
        return pieces

    def _packed(self, blocks: Sequence[tuple[bytes, Layers]]) -> Iterator[list[list[memoryview]]]:
        """Each block's written sections' payloads, converted into this thread's save staging buffer (one block a
        step: the caller frames each before the next is packed)."""
        g = self.geometry
        sizes = [g.section_bytes(s) for s in self.writes]
        per_block = sum(sizes)
        stage = self._staging.get("save", len(blocks) * per_block)
        for b, (_, layers) in enumerate(blocks):
            view = stage[b * per_block : (b + 1) * per_block]
            pack_block(g, self.part, layers, self.order, self.writes, view)
            offset, sections = 0, []
            for size in sizes:
                sections.append([view[offset : offset + size]])
                offset += size
            yield sections

    def _runs(self, layers: Layers, cuts: Sequence[tuple[range, int, int]]) -> list[list[memoryview]]:
        """Each section of ``cuts`` (:meth:`_cuts`) as its runs in ``layers`` (one a layer it covers)."""
        views = [layer_bytes(layer) for layer in layers]
        return [[views[i][offset:end] for i in rows] for rows, offset, end in cuts]

    def _cuts(self, sections: Sequence[Section], offsets: Sequence[int] | None) -> list[tuple[range, int, int]]:
        """Each of ``sections``' layers (indices into the rank's) and its byte range (one run) in each of them."""
        out = []
        for section, offset in zip(sections, offsets or (), strict=False):
            size = self.geometry.section_bytes(section) // section.layer_count
            first = section.layer_start - self.part.layer_start
            out.append((range(first, first + section.layer_count), offset, offset + size))
        return out

    def count_prefix(self, block_keys: Sequence[bytes]) -> int:
        """Leading blocks with every pack this rank needs present (an existence check only): one store call
        over the leading blocks for the pack size that hit last, others only where it stops."""
        n = 0
        while n < len(block_keys):
            for index in self._order():
                plan = self.plans[index]
                got = self.store.count_prefix([s.pack.key(k) for k in block_keys[n:] for s in plan]) // len(plan)
                if got:
                    n += got
                    self.hint = index
                    break
            else:
                return n
        return n

    def load_direct(self, blocks: Sequence[tuple[bytes, Layers]]) -> list[bool]:
        """Read each block's needed sections straight into its (writable) per-layer buffers, where
        :attr:`read_runs` says each is one run of each layer (else ValueError); whether each block is loaded.

        Each section is verified once, in place, after its read (as a per-rank frame read into the cache is):
        a block whose sections are not all present and valid may hold bad bytes and must not be offered; its
        reason is counted and a bad pack discarded."""
        if self.read_runs is None:
            raise ValueError("load_direct: this rank's sections are not single runs of its layers; use load")
        keys = [k for k, _ in blocks]
        stage = self._staging.get("load", len(keys) * len(self.reads) * HEADER_SIZE)
        headers = [stage[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] for i in range(len(keys) * len(self.reads))]
        payloads = [run for _, layers in blocks for run in self._runs(layers, self._read_cuts)]
        return self.read_blocks(keys, headers, payloads)

    def load(self, blocks: Sequence[tuple[bytes, Layers]]) -> int:
        """Load the leading blocks whose needed sections are all present and valid into their (writable)
        per-layer buffers; return how many. The first block that is not, and every one after it, is a miss."""
        fetched = self.fetch_many([key for key, _ in blocks])
        for n, ((_, layers), payloads) in enumerate(zip(blocks, fetched, strict=True)):
            if payloads is None:
                self.misses["blocks"] += len(blocks) - n
                return n
            unpack_block(self.geometry, self.part, layers, self.order, self.reads, payloads)
            self.loaded_blocks += 1
        return len(blocks)

    def fetch_many(self, block_keys: Sequence[bytes]) -> list[memoryview | None]:
        """The payloads of every needed section of each block, back to back and verified (read straight into
        place where the store can, one range read a pack); None for a block where any section is absent or bad
        (its reason counted, a bad pack discarded).

        Each byte is checked once, where it was read. The views lie in this thread's load staging buffer
        (reused, no allocation or page faults per call): they are valid until its next fetch."""
        g, per, n = self.geometry, len(self.reads), len(block_keys)
        sizes = [g.section_bytes(s) for s in self.reads]
        block_bytes = sum(sizes)
        stage = self._staging.get("load", n * (block_bytes + per * HEADER_SIZE))
        blocks = [stage[b * block_bytes : (b + 1) * block_bytes] for b in range(n)]
        at = n * block_bytes
        headers = [stage[at + i * HEADER_SIZE : at + (i + 1) * HEADER_SIZE] for i in range(n * per)]
        payloads: list[list[memoryview]] = []
        for buf in blocks:
            offset = 0
            for size in sizes:
                payloads.append([buf[offset : offset + size]])
                offset += size
        ok = self.read_blocks(block_keys, headers, payloads)
        return [buf if good else None for buf, good in zip(blocks, ok, strict=True)]


__all__ = ["CanonicalRank"]
