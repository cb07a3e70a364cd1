"""Device saves straight into a page-locked pool: each block's run copied from the device scratch into a slot.

CacheIO runs on CPU tensors with a host bounce (``staging=True``) and a recording CUDA; the pool is a real
:class:`HostPoolStore` page-locked through a recording registrar, so the copies are real. What is checked:
a save reserves one slot per block and copies each block's run into it (no staging ring), the writer's
``put_many`` then stores each block by adopting its slot (the frame is the slot: header written, nothing
copied); slots a failed save never stored go back to the pool when the ring comes round; a pageable
pool, or no pool, goes through the ring.
"""

from __future__ import annotations

import torch

from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.store.blockio import CacheIO, CacheIOs
from kvdi.connectors.store.framing import HEADER_SIZE, frame_header, unframe
from kvdi.connectors.streams import StreamOrder
from kvdi.testing.cuda_recording import RecordingCuda
from tests.connectors.test_cpu_offload_pinned import Registrar

LAYERS, BLOCKS, LAYER_BYTES = 2, 8, 64
BLOCK = LAYERS * LAYER_BYTES
FINGERPRINT = bytes(range(16))
KEYS = [bytes([k]) * 16 for k in range(4)]


def setup(pinned: bool = True) -> tuple[CacheIO, list[torch.Tensor], HostPoolStore, RecordingCuda]:
    caches = [torch.arange(BLOCKS * LAYER_BYTES // 4, dtype=torch.float32).view(BLOCKS, -1) * (k + 1)
              for k in range(LAYERS)]  # fmt: skip
    pool = HostPoolStore(6, HEADER_SIZE + BLOCK, pin_memory=pinned, registrar=Registrar())
    pool.put_many([(b"w" * 16, [b"warm"])])  # the pool is allocated (and page-locked) at its first write
    cuda = RecordingCuda()
    ios = CacheIOs(caches, LAYER_BYTES, 4, None, "t", staging=True, sink=pool)
    io = ios.io
    io.order = StreamOrder("cuda:0", cuda)
    return io, caches, pool, cuda


def block(caches: list[torch.Tensor], b: int) -> bytes:
    return b"".join(c[b].view(torch.uint8).numpy().tobytes() for c in caches)


def save(io: CacheIO, pool: HostPoolStore, ids: list[int], keys: list[bytes]) -> int:
    pieces = io.saved(io.start_save(ids))
    items = [(k, [frame_header(FINGERPRINT, p, name=k), *p]) for k, p in zip(keys, pieces, strict=True)]
    return pool.put_many(items)


def test_each_block_is_copied_once_into_a_reserved_slot_and_stored_by_adopting_it() -> None:
    io, caches, pool, cuda = setup()
    assert pool._pool is not None
    free_before = pool.num_slots - len(pool)
    assert save(io, pool, [5, 2], KEYS[:2]) == 2
    kinds = [e[0] for e in cuda.log]
    assert kinds == ["copy", *["gather"] * LAYERS, "copy", "copy", "record", "host_wait"]  # ids, gathers, 1/block
    for key, bid in zip(KEYS[:2], (5, 2), strict=True):
        slot, size = pool._lru[key]
        assert size == HEADER_SIZE + BLOCK
        assert bytes(unframe(pool._pool[slot, :size].data, FINGERPRINT, BLOCK, name=key)) == block(caches, bid)
    assert pool._reserved == {} and pool.num_slots - len(pool) == free_before - 2


def test_slots_a_failed_save_never_stored_go_back_to_the_pool() -> None:
    io, _caches, pool, _cuda = setup()
    io.saved(io.start_save([1, 3]))  # the write never happens (the store call failed)
    assert len(pool._reserved) == 2
    io.finish()
    assert pool._reserved == {} and len(pool._free) == 2
    assert save(io, pool, [4], KEYS[2:3]) == 1  # and they serve the next save


def test_a_pageable_pool_goes_through_the_staging_ring_and_copies_into_the_slot() -> None:
    io, caches, pool, cuda = setup(pinned=False)
    assert save(io, pool, [5], KEYS[:1]) == 1
    assert [e[0] for e in cuda.log] == ["copy", *["gather"] * LAYERS, "copy", "record", "host_wait"]
    assert pool._pool is not None
    slot, size = pool._lru[KEYS[0]]
    assert bytes(unframe(pool._pool[slot, :size].data, FINGERPRINT, BLOCK, name=KEYS[0])) == block(caches, 5)


def test_a_late_release_never_frees_a_slot_reserved_again_since() -> None:
    _io, _caches, pool, _cuda = setup()
    first = pool.reserve(1, BLOCK)
    assert first is not None
    (slot,) = pool._reserved
    pool.release(first)  # back to the pool ...
    again = pool.reserve(1, BLOCK)  # ... and lent again (the same slot, a new region object)
    assert again is not None and list(pool._reserved) == [slot]
    pool.release(first)  # a stale release of the first lending
    assert list(pool._reserved) == [slot]
