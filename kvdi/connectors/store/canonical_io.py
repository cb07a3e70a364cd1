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

import threading
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvdi.connectors.store.canonical import (
    HEADER_SIZE,
    Geometry,
    RankPart,
    Section,
    frame_section,
    read_plan,
    verify_section,
    write_plan,
)
from kvdi.connectors.store.canonical_convert import ORDERS, direct_runs, layer_bytes, pack_block, unpack_block
from kvdi.connectors.store.framing import MAGIC as PER_RANK_MAGIC
from kvdi.connectors.store.framing import Buffer, CorruptObjectError, FrameKey

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
        self._staging = Staging()
        self.write_runs = direct_runs(geometry, part, order, self.writes)
        """Each written section's offset in its layers' buffers (its bytes of a layer, one run), or None:
        converted through a staging buffer."""
        self.read_runs = direct_runs(geometry, part, order, self.reads)
        """The same for the sections read (:meth:`load_direct`)."""

    def object_bytes(self) -> int:
        """The size of every stored section object (uniform: the grid divides the model)."""
        return HEADER_SIZE + self.geometry.section_bytes(self.reads[0])

    def save(self, blocks: Sequence[tuple[bytes, Layers]]) -> int:
        """Write this rank's sections of each ``(block key, per-layer buffers)``; return objects written.

        Where each section's bytes of a layer are one run of it (:attr:`write_runs`) they are framed and
        written as they are, no copy; else packed into this thread's save staging buffer (reused: no
        allocation per call), one strided copy per layer. One checksum pass, one store call."""
        if not self.writes or not blocks:
            return 0
        g = self.geometry
        items: list[tuple[bytes, Sequence[Buffer]]] = []
        if self.write_runs is not None:  # no conversion: each section's bytes of a layer are one run of it
            for block_key, layers in blocks:
                runs = self._runs(layers, self.writes, self.write_runs)
                for section, payload in zip(self.writes, runs, strict=True):
                    name = section.key(block_key)
                    items.append((name, [frame_section(g, section, payload, self.key, name=name), *payload]))
        else:
            items = self._packed(blocks)
        written = self.store.put_many(items)
        self.written_bytes += written * self.object_bytes()
        return written

    def _packed(self, blocks: Sequence[tuple[bytes, Layers]]) -> list[tuple[bytes, Sequence[Buffer]]]:
        """The framed sections of ``blocks``, converted into this thread's save staging buffer."""
        g = self.geometry
        items: list[tuple[bytes, Sequence[Buffer]]] = []
        sizes = [g.section_bytes(s) for s in self.writes]
        per_block = sum(sizes)
        stage = self._staging.get("save", len(blocks) * per_block)
        for b, (block_key, layers) in enumerate(blocks):
            view = stage[b * per_block : (b + 1) * per_block]
            pack_block(g, self.part, layers, self.order, self.writes, view)
            offset = 0
            for section, size in zip(self.writes, sizes, strict=True):
                name, payload = section.key(block_key), view[offset : offset + size]
                offset += size
                items.append((name, [frame_section(g, section, payload, self.key, name=name), payload]))
        return items

    def _runs(self, layers: Layers, sections: Sequence[Section], offsets: Sequence[int]) -> list[list[memoryview]]:
        """Each of ``sections`` as its runs in ``layers`` (one a layer it covers, at its offset there)."""
        views = [layer_bytes(layer) for layer in layers]
        out = []
        for section, offset in zip(sections, offsets, strict=True):
            size = self.geometry.section_bytes(section) // section.layer_count
            first = section.layer_start - self.part.layer_start
            out.append([views[i][offset : offset + size] for i in range(first, first + section.layer_count)])
        return out

    def load_direct(self, blocks: Sequence[tuple[bytes, Layers]]) -> list[bool]:
        """Read each block's needed sections straight into its (writable) per-layer buffers, where
        :attr:`read_runs` says each is one run of each layer (else ValueError); whether each block is loaded.

        Each section is verified once, in place, after its read (as a per-rank frame read into the cache is):
        a block whose sections are not all present and valid may hold bad bytes and must not be offered; its
        reason is counted and a bad object discarded."""
        if self.read_runs is None:
            raise ValueError("load_direct: this rank's sections are not single runs of its layers; use load")
        per = len(self.reads)
        names = [s.key(k) for k, _ in blocks for s in self.reads]
        stage = self._staging.get("load", len(names) * HEADER_SIZE)
        headers = [stage[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] for i in range(len(names))]
        payloads = [run for _, layers in blocks for run in self._runs(layers, self.reads, self.read_runs)]
        try:
            got = self._read(names, headers, payloads)
        except Exception:  # a store call that fails is a miss, never an exception
            self.misses["error"] += 1
            return [False] * len(blocks)
        ok = [self._verdict(i, names, got, headers, payloads) for i in range(len(names))]
        return [all(ok[b * per : (b + 1) * per]) for b in range(len(blocks))]

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
            unpack_block(self.geometry, self.part, layers, self.order, self.reads, payloads)
            self.loaded_blocks += 1
        return len(blocks)

    def fetch_many(self, block_keys: Sequence[bytes]) -> list[memoryview | None]:
        """The payloads of every needed section of each block, back to back and verified (read straight into
        place where the store can, one store call for all); None for a block where any section is absent or
        bad (its reason counted, a bad object discarded).

        Each byte is checked once, where it was read. The views lie in this thread's load staging buffer
        (reused, no allocation or page faults per call): they are valid until its next fetch."""
        g, per, n = self.geometry, len(self.reads), len(block_keys)
        sizes = [g.section_bytes(s) for s in self.reads]
        block_bytes = sum(sizes)
        names = [s.key(k) for k in block_keys for s in self.reads]
        stage = self._staging.get("load", n * (block_bytes + per * HEADER_SIZE))
        blocks = [stage[b * block_bytes : (b + 1) * block_bytes] for b in range(n)]
        at = n * block_bytes
        headers = [stage[at + i * HEADER_SIZE : at + (i + 1) * HEADER_SIZE] for i in range(len(names))]
        payloads: list[list[memoryview]] = []
        for buf in blocks:
            offset = 0
            for size in sizes:
                payloads.append([buf[offset : offset + size]])
                offset += size
        try:
            got = self._read(names, headers, payloads)
        except Exception:  # a store call that fails is a miss, never an exception
            self.misses["error"] += 1
            return [None] * n
        out: list[memoryview | None] = []
        for b, buf in enumerate(blocks):
            ok = all(self._verdict(i, names, got, headers, payloads) for i in range(b * per, (b + 1) * per))
            out.append(buf if ok else None)
        return out

    def _read(
        self, names: list[bytes], headers: list[memoryview], payloads: list[list[memoryview]]
    ) -> list[int | bool | None]:
        """Each object read into its header and payload pieces: its size (None: absent), still to be checked
        (:meth:`_verdict`), or, from a store without ``get_into_many`` (S3, a plugin), whether it verified:
        such an object is checked in the buffer the store returned and copied into its pieces only when valid,
        so no byte of a bad section ever lands."""
        into = getattr(self.store, "get_into_many", None)
        if callable(into):
            pieces = [[h, *p] for h, p in zip(headers, payloads, strict=True)]
            sizes: list[int | bool | None] = into(list(zip(names, pieces, strict=True)))
        else:
            found = self.store.get_many(names)
            sizes = []
            if len(found) == len(names):
                for i, buf in enumerate(found):
                    sizes.append(self._checked_copy(i, names[i], buf, headers[i], payloads[i]))
        if len(sizes) != len(names):
            raise ValueError(f"the store answered {len(sizes)} of {len(names)} reads")
        return sizes

    def _checked_copy(
        self, i: int, name: bytes, buf: Buffer | None, header: memoryview, payload: list[memoryview]
    ) -> int | bool | None:
        """An object read whole: verified where it lies, then copied into ``header`` and ``payload`` if valid."""
        n = None if buf is None else memoryview(buf).nbytes
        if buf is None or n != header.nbytes + sum(x.nbytes for x in payload):
            return n  # absent or of the wrong size: :meth:`_verdict` counts why
        view = memoryview(buf).cast("B")
        offset = header.nbytes
        if not self._check(i, name, n, view[:offset], [view[offset:]]):
            return False
        header[:] = view[:offset]
        for x in payload:
            x[:] = view[offset : offset + x.nbytes]
            offset += x.nbytes
        return True

    def _verdict(
        self,
        i: int,
        names: list[bytes],
        got: list[int | bool | None],
        headers: list[memoryview],
        payloads: list[list[memoryview]],
    ) -> bool:
        """Whether object ``i`` read by :meth:`_read` is a valid section (checked now unless it already was)."""
        result = got[i]
        if isinstance(result, bool):
            return result
        return self._check(i, names[i], result, headers[i], payloads[i])

    def _odd(self, name: bytes) -> str:
        """Why an object of the wrong size is no section: ``old_format`` for a per-rank frame, else ``length``
        (read once more to tell; a store bounding reads to one section's size may not show it)."""
        try:
            (buf,) = self.store.get_many([name])
        except Exception:
            return "length"
        return "old_format" if buf is not None and bytes(memoryview(buf).cast("B")[:4]) == PER_RANK_MAGIC else "length"

    def _check(self, i: int, name: bytes, size: int | None, header: memoryview, payload: list[memoryview]) -> bool:
        section = self.reads[i % len(self.reads)]
        if size is None or size == 0:
            self.misses["absent"] += 1
            return False
        self.read_bytes += size
        try:
            if size != header.nbytes + sum(p.nbytes for p in payload):
                raise CorruptObjectError(self._odd(name), f"object of {size} B, a section is {header.nbytes} B more")
            verify_section(header, payload, self.geometry, section, self.key, name=name)
        except CorruptObjectError as exc:
            self.misses[exc.reason] += 1
            try:
                self.store.discard(name)  # never offered again
            except Exception:
                self.misses["error"] += 1
            return False
        return True


__all__ = ["CanonicalRank"]
