"""Device loads straight out of a page-locked pool: one run per block from the slot to the device, no host copy.

CacheIO runs on CPU tensors with a host bounce (``staging=True``) and a recording CUDA (as in
``test_cuda_discipline``); ``Pinned`` stands in for page-locked memory by reporting every lent frame
as pinned. The pool is a real :class:`HostPoolStore`, the frames real frames. What is checked: each
block is copied once from its slot into the device scratch while the CPU verifies the frame, and the
host waits for that copy before the pool's lock is released; the staging ring is not copied; a corrupt
slot is dropped and nothing of it reaches the cache; a frame in pageable memory goes through staging.
"""

from __future__ import annotations

import torch

from kvdi.connectors.base import ConnectorStats
from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.store.blockio import CacheIO
from kvdi.connectors.store.framing import HEADER_SIZE, frame_header
from kvdi.connectors.store.protocol import StoreCapabilities
from kvdi.connectors.store.reads import place_frame, read_chunk, verify_chunk
from kvdi.connectors.streams import StreamOrder
from kvdi.testing.cuda_recording import RecordingCuda

LAYERS, BLOCKS, LAYER_BYTES = 2, 8, 64
BLOCK = LAYERS * LAYER_BYTES
FINGERPRINT = bytes(range(16))
KEYS = [bytes([k]) * 16 for k in range(3)]


class Pinned(CacheIO):
    """A CacheIO that takes every lent frame of the right size for page-locked memory."""

    def _pinned_payload(self, frame: memoryview) -> torch.Tensor | None:
        ok = frame.nbytes == HEADER_SIZE + BLOCK
        return torch.frombuffer(frame, dtype=torch.uint8)[HEADER_SIZE:] if ok else None


def setup(io_class: type[CacheIO]) -> tuple[CacheIO, list[torch.Tensor], HostPoolStore, RecordingCuda]:
    caches = [torch.zeros(BLOCKS, LAYER_BYTES // 4) for _ in range(LAYERS)]
    cuda = RecordingCuda()
    io = io_class(caches, LAYER_BYTES, chunk=4, staging=True, order=StreamOrder("cuda:0", cuda))
    pool = HostPoolStore(4, HEADER_SIZE + BLOCK)
    for n, key in enumerate(KEYS):
        payload = bytes([n + 1]) * BLOCK
        pool.put_many([(key, [frame_header(FINGERPRINT, payload, name=key), payload])])
    return io, caches, pool, cuda


def place(frame: memoryview, key: bytes, pieces: tuple[memoryview, ...] | list[memoryview]) -> None:
    place_frame(frame, pieces, FINGERPRINT, BLOCK, name=key)


def load(io: CacheIO, pool: HostPoolStore, ids: list[int]) -> ConnectorStats:
    stats = ConnectorStats()
    io.begin()
    chunk = read_chunk(pool, StoreCapabilities.of(pool), place, io, ids, KEYS[: len(ids)])
    verify_chunk(io, chunk, stats, FINGERPRINT, BLOCK, lambda *a: None, pool.discard)
    io.finish()
    return stats


def test_each_block_is_copied_once_from_its_slot_to_the_device_while_the_cpu_verifies_it() -> None:
    io, caches, pool, cuda = setup(Pinned)
    stats = load(io, pool, [5, 2, 7])
    assert stats.loaded_blocks == 3 and stats.corrupt_dropped == 0
    for bid, value in ((5, 1), (2, 2), (7, 3)):
        assert all(bool((c[bid].view(torch.uint8) == value).all()) for c in caches)
    straight = [("copy", "compute"), ("record", "e1", "compute"), ("host_wait", "e1", "compute")]
    assert cuda.log[:3] == straight  # slot -> device scratch, waited for before the pool's lock is released
    assert [e[0] for e in cuda.log[9:]] == ["copy", *["scatter"] * LAYERS, "record", "host_wait"]
    assert sum(1 for e in cuda.log if e[0] == "copy") == 3 + 1  # one per block, the ids once; the ring never


def test_a_corrupt_slot_is_dropped_and_nothing_of_it_reaches_the_cache() -> None:
    io, caches, pool, _cuda = setup(Pinned)
    assert pool._pool is not None
    slot = pool._lru[KEYS[1]][0]
    pool._pool[slot, HEADER_SIZE + 3] ^= 0xFF  # one flipped byte in the second block's payload
    stats = load(io, pool, [5, 2, 7])
    assert (stats.loaded_blocks, stats.corrupt_dropped) == (1, 1)
    assert all(bool((c[5].view(torch.uint8) == 1).all()) for c in caches)
    assert not any(bool(c[2].any()) or bool(c[7].any()) for c in caches)
    assert pool.count_prefix(KEYS[1:2]) == 0  # discarded from the pool


def test_a_frame_in_pageable_memory_goes_through_staging() -> None:
    io, caches, pool, cuda = setup(CacheIO)  # the real check: a numpy pool is not page-locked
    stats = load(io, pool, [5, 2])
    assert stats.loaded_blocks == 2
    assert all(bool((c[2].view(torch.uint8) == 2).all()) for c in caches)
    assert [e[0] for e in cuda.log] == ["copy", "copy", *["scatter"] * LAYERS, "record", "host_wait"]


def test_a_row_copied_straight_but_never_committed_does_not_skip_the_next_chunks_staged_copy() -> None:
    """A bad block's row was copied straight and dropped; the next chunk, placed through staging, still
    copies its staged rows to the device (the straight mark belongs to the chunk that made it)."""
    io, caches, pool, _cuda = setup(Pinned)
    assert pool._pool is not None
    pool._pool[pool._lru[KEYS[0]][0], HEADER_SIZE] ^= 0xFF
    assert load(io, pool, [5]).corrupt_dropped == 1
    io._pinned_payload = lambda frame: None  # type: ignore[method-assign]  # the next frames: pageable
    pool.put_many([(KEYS[0], [frame_header(FINGERPRINT, bytes([9]) * BLOCK, name=KEYS[0]), bytes([9]) * BLOCK])])
    assert load(io, pool, [6]).loaded_blocks == 1
    assert all(bool((c[6].view(torch.uint8) == 9).all()) for c in caches)
