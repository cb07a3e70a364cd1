"""Reading and verifying one chunk of stored blocks into the paged cache (used by the store worker half).

:func:`read_chunk` makes one store call for a chunk, in the cheapest way the store offers:
a store that can lend its bytes (``visit_many``, e.g. cpu_offload's pool) has each frame
verified and copied piece by piece where it lies (:func:`place_frame`: each piece is hashed and
copied while it is in the CPU cache, one pass over memory, like a plain copy); a store that reads
into caller buffers (``get_into_many``) reads straight into the cache, verified after; any other
store returns bytes that are verified and copied. "The cache" is the paged cache itself (a CPU
cache) or the pinned staging chunk a device cache's blocks are copied in from. :func:`verify_chunk`
then counts and places each block, stopping at the first bad one, which is counted and dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from kvdi.connectors.base import ConnectorStats
from kvdi.connectors.store.codec import unframe_into
from kvdi.connectors.store.framing import (
    HEADER_SIZE,
    Buffer,
    CorruptObjectError,
    FrameKey,
    PayloadHasher,
    frame_codec,
    read_header,
    verify_pieces,
)
from kvdi.connectors.store.protocol import BlockStore, ReadIntoStore, StoreCapabilities, ViewStore

if TYPE_CHECKING:
    from kvdi.connectors.store.blockio import CacheIO


@dataclass
class ReadChunk:
    """Blocks of one store call, read but not yet verified (``visited``: verified and placed in the store call)."""

    ids: Sequence[int]
    keys: Sequence[bytes]
    pieces: list[list[memoryview]]
    headers: list[bytearray]
    sizes: list[int | None]
    objects: list[Buffer | None]
    visited: list[BaseException | None] | None = None


PLACE_BYTES = 256 << 10  # bytes copied then hashed at a time: what was copied is still in the CPU cache


def place_frame(
    frame: Buffer,
    pieces: Sequence[memoryview],
    fingerprint: bytes,
    block_bytes: int,
    mac_key: FrameKey | None = None,
    *,
    name: Buffer,
) -> None:
    """Verify the whole frame ``frame`` of block ``name`` and copy its payload into ``pieces`` in one pass:
    each span of up to :data:`PLACE_BYTES` is hashed, then copied while it is in the CPU cache.

    Raises CorruptObjectError (header faults before any byte is copied); on a bad checksum or MAC the
    pieces hold the bad payload, so the caller must treat the block as not loaded. No ``pieces``: the
    frame is verified only (its payload is copied elsewhere: straight to a device).
    """
    view = frame if isinstance(frame, memoryview) and frame.format == "B" else memoryview(frame).cast("B")
    header = view[:HEADER_SIZE]
    read = read_header(header, fingerprint, block_bytes, name=name)  # header faults first, once
    if frame_codec(header):  # compressed (network stores): checked whole, decompressed into place
        return unframe_into(view, pieces, fingerprint, block_bytes, mac_key, name=name)
    if view.nbytes != HEADER_SIZE + block_bytes:
        raise CorruptObjectError("length", f"object of {view.nbytes} B, expected {HEADER_SIZE + block_bytes} B")
    hasher = PayloadHasher(mac_key)
    update = hasher.feed(block_bytes)  # the hash's own update: no bookkeeping per piece
    if not pieces:  # verify only: the payload is being copied straight to a device (CacheIO.load_straight)
        for start in range(HEADER_SIZE, view.nbytes, PLACE_BYTES):
            update(view[start : start + PLACE_BYTES])
        return hasher.verify(header, fingerprint, block_bytes, name=name, read=read)
    offset = HEADER_SIZE
    for piece in pieces:
        dst = piece if piece.format == "B" else piece.cast("B")
        n = dst.nbytes
        if n <= PLACE_BYTES:  # a layer's piece: one copy, then its hash while it is in the CPU cache
            dst[:] = view[offset : offset + n]
            update(dst)
        else:
            for start in range(0, n, PLACE_BYTES):
                span = dst[start : start + PLACE_BYTES]
                span[:] = view[offset + start : offset + start + span.nbytes]
                update(span)  # what landed, while it is in the CPU cache (a copy's stores leave it there)
        offset += n
    if offset != view.nbytes:
        raise CorruptObjectError("length", f"pieces of {offset - HEADER_SIZE} B for a {block_bytes} B payload")
    hasher.verify(header, fingerprint, block_bytes, name=name, read=read)


def read_chunk(
    store: BlockStore,
    caps: StoreCapabilities,
    place: Callable[[memoryview, bytes, Sequence[memoryview]], None],
    io: CacheIO,
    ids: Sequence[int],
    keys: Sequence[bytes],
) -> ReadChunk:
    """One store call for ``keys``; raises whatever the store raises, or TypeError on a reply of the wrong shape.

    ``place(frame, key, pieces)`` verifies a whole frame stored under ``key`` and copies its payload into
    ``pieces`` (raising CorruptObjectError: :func:`place_frame`).
    """
    pieces = [io.load_pieces(i, bid) for i, bid in enumerate(ids)]
    if caps.visit:
        outcome: list[BaseException | None] = [None] * len(ids)
        straight = not io.direct  # a device cache: a frame lent in page-locked memory goes straight to it

        def visit(i: int, frame: memoryview) -> None:
            try:
                plain = frame.nbytes > HEADER_SIZE and not frame_codec(frame[:HEADER_SIZE])
                if straight and plain and io.load_straight(i, frame):
                    try:
                        place(frame, keys[i], ())  # verified on the CPU while the device copies it
                    finally:
                        io.release_lent()  # the copy is done before the store may reuse the frame
                else:
                    place(frame, keys[i], pieces[i])
            except Exception as exc:  # recorded, never raised into the store
                outcome[i] = exc

        present = cast(ViewStore, store).visit_many(keys, visit)
        if not isinstance(present, list) or len(present) != len(keys):
            raise TypeError(f"visit_many returned {type(present).__name__} for {len(keys)} keys")
        sizes: list[int | None] = [1 if p is True else None for p in present]  # present (its size was checked)
        return ReadChunk(ids, keys, pieces, [], sizes, [None] * len(ids), outcome)
    if caps.place is not None:  # canonical sections: each verified once, as it is read
        sizes = caps.place(list(zip(keys, pieces, strict=True)))
        if not isinstance(sizes, list) or len(sizes) != len(keys):
            raise TypeError(f"place_many returned {type(sizes).__name__} for {len(keys)} keys")
        return ReadChunk(ids, keys, pieces, [], sizes, [None] * len(ids), [None] * len(ids))
    headers = [bytearray(HEADER_SIZE) for _ in ids]
    if caps.read_into:
        targets = [(k, [memoryview(h), *p]) for k, h, p in zip(keys, headers, pieces, strict=True)]
        sizes = cast(ReadIntoStore, store).get_into_many(targets)
        objects: list[Buffer | None] = [None] * len(ids)
    else:
        objects = store.get_many(keys)
        if not isinstance(objects, list) or len(objects) != len(keys):
            raise TypeError(f"get_many returned {type(objects).__name__} for {len(keys)} keys")
        sizes = [None if o is None else memoryview(o).nbytes for o in objects]
    if not isinstance(sizes, list) or len(sizes) != len(keys):
        raise TypeError(f"get_into_many returned {type(sizes).__name__} for {len(keys)} keys")
    if caps.read_into:  # an object shorter than a frame was compressed by its writer: read it whole, then check it
        short = [i for i, n in enumerate(sizes) if isinstance(n, int) and HEADER_SIZE < n < _frame(pieces[i])]
        whole = store.get_many([keys[i] for i in short]) if short else []
        for i, obj in zip(short, whole, strict=True):
            objects[i], sizes[i] = obj, None if obj is None else memoryview(obj).nbytes
    return ReadChunk(ids, keys, pieces, headers, sizes, objects)


def _frame(pieces: Sequence[memoryview]) -> int:
    return HEADER_SIZE + sum(p.nbytes for p in pieces)


def verify_chunk(
    io: CacheIO,
    chunk: ReadChunk,
    stats: ConnectorStats,
    fingerprint: bytes,
    block_bytes: int,
    log_once: Callable[..., None],
    discard: Callable[[bytes], None],
    mac_key: FrameKey | None = None,
) -> int:
    """Check (and place) a read chunk; return how many leading blocks are in place.

    The first bad block stops the chunk: a vanished one counts as a load failure, a bad
    frame (or any exception checking it) as ``corrupt_dropped`` and is discarded.
    """
    frame_bytes = HEADER_SIZE + block_bytes
    for i, (bid, key) in enumerate(zip(chunk.ids, chunk.keys, strict=True)):
        size, obj = chunk.sizes[i], chunk.objects[i]
        try:
            if size is None:
                stats.load_failures += 1
                log_once("missing", "a stored block vanished before it was loaded (evicted?), recomputing")
                return i
            if chunk.visited is not None:  # verified and placed inside the store call
                failed = chunk.visited[i]
                if failed is not None:
                    raise failed
            elif obj is None:  # read straight into the cache
                if size != frame_bytes:
                    raise CorruptObjectError("length", f"object of {size} B, expected {frame_bytes} B")
                verify_pieces(chunk.headers[i], chunk.pieces[i], fingerprint, block_bytes, mac_key, name=key)
            else:
                unframe_into(obj, chunk.pieces[i], fingerprint, block_bytes, mac_key, name=key)
        except CorruptObjectError as exc:
            stats.corrupt_dropped += 1
            log_once(f"corrupt:{exc.reason}", "dropping a stored block: %s", exc)
            discard(key)
            return i
        except Exception as exc:
            stats.corrupt_dropped += 1
            log_once(f"odd:{type(exc).__name__}", "dropping a stored block that could not be checked: %r", exc)
            discard(key)
            return i
        io.commit_load(i, bid)
        stats.loaded_blocks += 1
        stats.loaded_bytes += block_bytes
    return len(chunk.ids)


class Readahead:
    """Keeps a store's ``prefetch`` about ``window`` blocks ahead of the reads of one load, while it pays."""

    def __init__(self, prefetch: Callable[[Sequence[bytes]], bool] | None, keys: Sequence[bytes], window: int) -> None:
        self._prefetch, self._keys, self._window, self._upto = prefetch, keys, window, 0

    def before(self, start: int) -> None:
        """Called before reading from block ``start`` on: ask for the blocks up to ``start + window``."""
        if self._prefetch is None:
            return
        end = min(len(self._keys), start + self._window)
        if end <= self._upto or (self._upto and end - self._upto < self._window // 4):
            return  # ask in batches of a quarter window at least
        try:
            more = self._prefetch(self._keys[self._upto : end])
        except Exception:  # a hint only
            more = False
        self._upto = end
        if not more:
            self._prefetch = None  # the objects are in fast memory: reading ahead buys nothing for this load


__all__ = ["PLACE_BYTES", "ReadChunk", "Readahead", "place_frame", "read_chunk", "verify_chunk"]
