"""Reading and verifying one chunk of stored blocks into the paged cache (used by the store worker half).

:func:`read_chunk` makes one store call for a chunk (read straight into the cache when the
store can); :func:`verify_chunk` checks each object's frame and places it, stopping at the
first bad one, which is counted and dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from kvdi.connectors.base import ConnectorStats
from kvdi.connectors.store.framing import HEADER_SIZE, Buffer, CorruptObjectError, FrameKey, unframe, verify_pieces
from kvdi.connectors.store.protocol import BlockStore, ReadIntoStore

if TYPE_CHECKING:
    from kvdi.connectors.store.blockio import CacheIO


@dataclass
class ReadChunk:
    """Blocks of one store call, read but not yet verified."""

    ids: Sequence[int]
    keys: Sequence[bytes]
    pieces: list[list[memoryview]]
    headers: list[bytearray]
    sizes: list[int | None]
    objects: list[Buffer | None]


def read_chunk(store: BlockStore, read_into: bool, io: CacheIO, ids: Sequence[int], keys: Sequence[bytes]) -> ReadChunk:
    """One store call for ``keys``; raises whatever the store raises, or TypeError on a reply of the wrong shape."""
    pieces = [io.load_pieces(i, bid) for i, bid in enumerate(ids)]
    headers = [bytearray(HEADER_SIZE) for _ in ids]
    if read_into and io.direct:
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
    return ReadChunk(ids, keys, pieces, headers, sizes, objects)


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
            if obj is None:  # read straight into the cache
                if size != frame_bytes:
                    raise CorruptObjectError("length", f"object of {size} B, expected {frame_bytes} B")
                verify_pieces(chunk.headers[i], chunk.pieces[i], fingerprint, block_bytes, mac_key, name=key)
            else:
                io.copy_payload(unframe(obj, fingerprint, block_bytes, mac_key, name=key), chunk.pieces[i])
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


__all__ = ["ReadChunk", "read_chunk", "verify_chunk"]
