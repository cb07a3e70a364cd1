"""A rank's reads of canonical packs: its sections' byte range of each pack, each section verified on its own.

:class:`RangeReader` reads, for each block, the sections a rank needs from the packs of one size
(:mod:`.canonical_pack`): one bounded range read a pack, straight into the destination pieces,
from a store with ``get_range_into_many`` (shared_storage: one ``pread``); from any other store
each pack is read whole, verified where it lies, and copied into its pieces only when valid, so no
byte of a bad section ever lands. A block whose packs of one size are absent is tried with the next
size (the size that hit last first); one no size holds is an ``absent`` miss, one with a bad section
a miss by its reason (the pack discarded).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from kvdi.connectors.store.canonical import HEADER_SIZE, Geometry, Section, checked_fields, verify_section
from kvdi.connectors.store.canonical_pack import Span, frame_bytes, pack_bytes
from kvdi.connectors.store.framing import MAGIC as PER_RANK_MAGIC
from kvdi.connectors.store.framing import Buffer, CorruptObjectError, FrameKey, name_field

if TYPE_CHECKING:
    from kvdi.connectors.store.protocol import BlockStore

Read = tuple[bytes, int, list[memoryview]]
"""A range read: the pack's key, the offset of the first byte, the pieces the range is read into."""


class RangeReader:
    """Reads and verifies a rank's sections ``reads`` of blocks from their packs in ``store`` (see the module)."""

    plans: list[list[Span]]

    def __init__(self, store: BlockStore, geometry: Geometry, key: FrameKey | None, reads: list[Section]) -> None:
        self.store = store
        self.geometry = geometry
        self.key = key
        self.reads = reads
        self.misses: Counter[str] = Counter()
        self.read_bytes = 0
        self.hint = 0
        """The plan (pack size) that found blocks last: tried first."""
        self._frame = frame_bytes(geometry)
        self._checked = [checked_fields(geometry, s, bytes(16)) for s in reads]  # with the name field zero

    def _order(self) -> list[int]:
        return [self.hint, *(i for i in range(len(self.plans)) if i != self.hint)]

    def read_blocks(
        self, keys: Sequence[bytes], headers: list[memoryview], payloads: list[list[memoryview]]
    ) -> list[bool]:
        """Read the sections of each block ``keys[b]`` into ``headers[b * per + i]`` and ``payloads[b * per + i]``
        (section ``i`` of :attr:`reads`); whether each block's sections are all present and valid."""
        per, result = len(self.reads), [False] * len(keys)
        pending = list(range(len(keys)))
        for index in self._order():
            if not pending:
                break
            plan = self.plans[index]
            reads: list[Read] = []
            for b in pending:
                for span in plan:
                    first = b * per + span.first
                    pieces = [x for i in range(first, first + span.count) for x in (headers[i], *payloads[i])]
                    reads.append((span.pack.key(keys[b]), span.offset, pieces))
            try:
                got = self._read(reads, plan)
            except Exception:  # a store call that fails is a miss, never an exception
                self.misses["error"] += 1
                return result
            still = []
            for n, b in enumerate(pending):
                mine = slice(n * len(plan), (n + 1) * len(plan))
                state = self._block(b, plan, got[mine], reads[mine], headers, payloads)
                if state is None:
                    still.append(b)
                else:
                    result[b] = state
                    self.hint = index if state else self.hint
            pending = still
        if pending:
            self.misses["absent"] += len(pending)
        return result

    def _block(
        self,
        b: int,
        plan: list[Span],
        got: list[int | bool | None],
        reads: list[Read],
        headers: list[memoryview],
        payloads: list[list[memoryview]],
    ) -> bool | None:
        """Whether block ``b``'s packs of ``plan`` hold all its sections valid; None when one is absent."""
        if any(size is None or size == 0 for size in got):
            return None
        per = len(self.reads)
        for span, size, (name, _, _) in zip(plan, got, reads, strict=True):
            if isinstance(size, bool) or size is None:  # verified already (None: never, checked above)
                if not size:
                    return False
                continue
            mine = slice(b * per + span.first, b * per + span.first + span.count)
            if not self._check(name, size, span, headers[mine], payloads[mine]):
                return False
        return True

    def _read(self, reads: list[Read], plan: list[Span]) -> list[int | bool | None]:
        """Each range read into its pieces: the pack's size (None: absent), still to be checked, or, where read
        whole by ``get_many``, whether its sections verified (checked in the pack the store returned and copied
        into the pieces only when valid). Ranges go through ``get_range_into_many`` where the store has it
        (shared_storage: one ``preadv``); else a range that is the whole pack through ``get_into_many`` (Redis: the
        socket's bytes land in place); other reads take the pack whole."""
        sizes: list[int | bool | None] = [None] * len(reads)
        whole: list[int] = []
        part: list[int] = []
        rest: list[int] = []
        into = getattr(self.store, "get_into_many", None)
        ranged = getattr(self.store, "get_range_into_many", None)
        for n, (_, offset, _) in enumerate(reads):
            span = plan[n % len(plan)]
            if callable(ranged):  # shared_storage: a preadv of the range, whole pack or part
                part.append(n)
            elif callable(into) and offset == 0 and span.count * self.geometry.section_heads == span.pack.head_count:
                whole.append(n)
            else:
                rest.append(n)
        if whole:
            assert callable(into)
            self._fill(sizes, whole, into([(reads[n][0], reads[n][2]) for n in whole]))
        if part:
            assert callable(ranged)
            self._fill(sizes, part, ranged([reads[n] for n in part]))
        if rest:
            found = self.store.get_many([reads[n][0] for n in rest])
            checked = [
                self._checked_copy(reads[n], plan[n % len(plan)], buf) for n, buf in zip(rest, found, strict=False)
            ]
            self._fill(sizes, rest, checked)
        return sizes

    @staticmethod
    def _fill(sizes: list[int | bool | None], at: list[int], got: Sequence[int | bool | None]) -> None:
        if len(got) != len(at):
            raise ValueError(f"the store answered {len(got)} of {len(at)} reads")
        for n, size in zip(at, got, strict=True):
            sizes[n] = size

    def _checked_copy(self, read: Read, span: Span, buf: Buffer | None) -> int | bool | None:
        """A pack read whole: its span's sections verified where they lie, then copied into the pieces if valid."""
        name, offset, pieces = read
        size = None if buf is None else memoryview(buf).nbytes
        if buf is None or size != pack_bytes(self.geometry, span.pack):
            return size  # absent or of the wrong size: :meth:`_check` counts why
        view = memoryview(buf).cast("B")
        at, headers, payloads = offset, [], []
        for i in range(span.first, span.first + span.count):
            section = self.reads[i]
            n = self.geometry.section_bytes(section)
            headers.append(view[at : at + HEADER_SIZE])
            payloads.append([view[at + HEADER_SIZE : at + HEADER_SIZE + n]])
            at += HEADER_SIZE + n
        if not self._check(name, size, span, headers, payloads):
            return False
        at = offset
        for piece in pieces:
            piece[:] = view[at : at + piece.nbytes]
            at += piece.nbytes
        return True

    def _odd(self, name: bytes) -> str:
        """Why an object of the wrong size is no pack: ``old_format`` for a per-rank frame, else ``length``."""
        ranged = getattr(self.store, "get_range_into_many", None)
        try:
            if callable(ranged):  # its first 4 bytes only (a file of any size under the name)
                head = memoryview(bytearray(4))
                buf: Buffer | None = head if ranged([(name, 0, [head])])[0] else None
            else:
                (buf,) = self.store.get_many([name])
        except Exception:
            return "length"
        return "old_format" if buf is not None and bytes(memoryview(buf).cast("B")[:4]) == PER_RANK_MAGIC else "length"

    def _check(
        self, name: bytes, size: int, span: Span, headers: list[memoryview], payloads: list[list[memoryview]]
    ) -> bool:
        """Whether the sections of ``span`` read from pack ``name`` (of ``size`` bytes) are valid; the first
        bad one's reason counted and the pack discarded (never offered again)."""
        self.read_bytes += span.count * self._frame
        try:
            expected = pack_bytes(self.geometry, span.pack)
            if size != expected:
                raise CorruptObjectError(self._odd(name), f"object of {size} B, a pack of {span.pack} is {expected} B")
            field = name_field(name)
            for i, (header, payload) in enumerate(zip(headers, payloads, strict=True)):
                zero = self._checked[span.first + i]
                if self.key is None and _sound(header, payload, zero[:24] + field + zero[40:]):
                    continue  # every field as expected and the checksum right: what verify_section checks, faster
                verify_section(header, payload, self.geometry, self.reads[span.first + i], self.key, name=name)
        except CorruptObjectError as exc:
            self.misses[exc.reason] += 1
            try:
                self.store.discard(name)
            except Exception:
                self.misses["error"] += 1
            return False
        return True


def _sound(header: memoryview, payload: list[memoryview], checked: bytes) -> bool:
    """Whether an unkeyed section's header is exactly ``checked`` then its checksum of ``payload``, MAC field zero."""
    if header[:88] != checked or any(header[96:HEADER_SIZE]):
        return False
    h = xxhash.xxh3_64()
    for piece in payload:
        h.update(piece)
    h.update(checked)
    return h.intdigest() == int.from_bytes(header[88:96], "little")


__all__ = ["RangeReader", "Read"]
