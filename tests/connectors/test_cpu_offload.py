"""cpu_offload: a host pool of fixed slots with LRU eviction, shared by both halves of one engine."""

from __future__ import annotations

import pytest
import torch

from kvdi.connectors.base import KVConnectorRole
from kvdi.connectors.cpu_offload import HostPoolStore, open_store
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.keys import block_keys
from kvdi.containers import build_kv_container
from kvdi.errors import ConfigError
from kvdi.settings import CpuOffloadSettings
from tests.helpers.store import Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
FRAME = HEADER_SIZE + LAYOUT.block_bytes
PROMPT = request(range(18))
KEYS = block_keys(PROMPT.prompt_token_ids, LAYOUT)


def pool(slots: int) -> HostPoolStore:
    return open_store(CpuOffloadSettings(max_bytes=slots * FRAME + FRAME - 1), LAYOUT, make_settings())


def test_pool_has_max_bytes_over_frame_slots() -> None:
    store = pool(5)
    assert (store.num_slots, store.slot_bytes) == (5, FRAME)


def test_every_payload_of_a_pageable_pool_starts_on_a_cache_line_and_is_kept_whole() -> None:
    """A frame right at a slot's start puts its payload 24 bytes off a line (copies ~20 % slower): slots are padded."""
    store = pool(3)
    frames = [(bytes([k]) * 16, [bytes([k]) * HEADER_SIZE, bytes([k + 1]) * LAYOUT.block_bytes]) for k in (1, 2, 3)]
    assert store.put_many(frames) == 3
    for key, pieces in frames:
        slot, size = store._lru[key]
        assert store._slots()[slot, HEADER_SIZE:].ctypes.data % 64 == 0
        assert bytes(store._slots()[slot, :size]) == b"".join(pieces)
    assert [bytes(o or b"") for o in store.get_many([k for k, _ in frames])] == [b"".join(p) for _, p in frames]


def test_max_bytes_below_one_frame_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="KVDI_CPU_OFFLOAD__MAX_BYTES"):
        open_store(CpuOffloadSettings(max_bytes=FRAME - 1), LAYOUT, make_settings())


def test_round_trip_restores_every_byte() -> None:
    store = pool(8)
    producer = Engine(store, LAYOUT, make_settings(), seed=5)
    producer.prefill(PROMPT, (1, 2, 3, 4, 5))
    consumer = Engine(store, LAYOUT, make_settings())
    assert consumer.prefill(PROMPT, (9, 10, 11, 12, 13)) == (16, set())
    assert torch.equal(torch.stack(producer.block(4)), torch.stack(consumer.block(12)))


def test_full_pool_evicts_the_least_recently_used_chain_tail_first() -> None:
    store = pool(6)
    old, new = request(range(100, 118), "old"), request(range(200, 218), "new")
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(old, (1, 2, 3, 4, 5))
    Engine(store, LAYOUT, make_settings(), seed=2).prefill(new, (1, 2, 3, 4, 5))
    assert len(store) == 6
    assert store.count_prefix(block_keys(new.prompt_token_ids, LAYOUT)) == 4
    assert store.count_prefix(block_keys(old.prompt_token_ids, LAYOUT)) == 2


def test_reading_a_chain_makes_it_recently_used() -> None:
    store = pool(8)
    a, b, c = (request(range(s, s + 18), str(s)) for s in (100, 200, 300))
    for r in (a, b):
        Engine(store, LAYOUT, make_settings(), seed=1).prefill(r, (1, 2, 3, 4, 5))
    Engine(store, LAYOUT, make_settings()).prefill(a, (1, 2, 3, 4, 5))  # a is now fresher than b
    Engine(store, LAYOUT, make_settings(), seed=3).prefill(c, (1, 2, 3, 4, 5))
    assert store.count_prefix(block_keys(a.prompt_token_ids, LAYOUT)) == 4
    assert store.count_prefix(block_keys(b.prompt_token_ids, LAYOUT)) == 0


def test_corrupt_slot_is_dropped_and_counted() -> None:
    store = pool(8)
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    obj = store.get_many([KEYS[1]])[0]
    assert obj is not None
    bad = bytearray(obj)
    bad[HEADER_SIZE + 3] ^= 1
    store.put_many([(KEYS[1], [bad])])
    engine = Engine(store, LAYOUT, make_settings())
    assert engine.prefill(PROMPT, (1, 2, 3, 4, 5)) == (16, {2, 3, 4})
    assert engine.worker.stats.corrupt_dropped == 1
    assert store.count_prefix(KEYS) == 1


def test_objects_larger_than_a_slot_are_not_kept() -> None:
    store = pool(2)
    store.put_many([(b"k" * 16, [bytes(FRAME + 1)])])
    assert store.count_prefix([b"k" * 16]) == 0


def test_both_halves_of_one_container_share_one_pool() -> None:
    container = build_kv_container(
        kv_connector="cpu_offload", cpu_offload={"max_bytes": 1 << 22}, model={"num_layers": 2}, engine_id="e"
    )
    try:
        scheduler, worker = container.scheduler_connector(), container.worker_connector()
        assert isinstance(scheduler.context.backend, HostPoolStore)
        assert scheduler.context.backend is worker.context.backend
        assert worker.context.role is KVConnectorRole.WORKER
    finally:
        container.shutdown_resources()


def test_close_empties_the_pool() -> None:
    store = pool(4)
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    store.close()
    assert store.count_prefix(KEYS) == 0


def test_a_load_through_visit_many_is_byte_for_byte_and_a_flipped_payload_byte_is_a_counted_miss() -> None:
    """Loads verify and copy each frame where it lies in the pool (visit_many, one pass: each span hashed, then
    copied while in the CPU cache); a flipped payload byte is caught there and the blocks from it on recompute."""
    store = pool(8)
    producer = Engine(store, LAYOUT, make_settings(), seed=7)
    producer.prefill(PROMPT, (1, 2, 3, 4, 5))
    assert producer.worker.stats.saved_blocks == 4
    consumer = Engine(store, LAYOUT, make_settings())
    assert consumer.prefill(PROMPT, (9, 10, 11, 12, 13)) == (16, set())
    assert torch.equal(torch.stack(producer.block(2)), torch.stack(consumer.block(10)))
    slot, _size = store._lru[KEYS[1]]
    store._slots()[slot, HEADER_SIZE + 5] ^= 0xFF
    third = Engine(store, LAYOUT, make_settings())
    loaded, failed = third.prefill(PROMPT, (6, 7, 8, 14, 15))
    assert loaded == 16 and failed == {7, 8, 14}  # blocks from the bad one on are recomputed
    assert third.worker.stats.corrupt_dropped == 1


def test_saves_from_a_cpu_cache_come_about_4_mib_per_put_many() -> None:
    """One put_many per block cost a lock and an LRU pass per block: the pool asks for batches of ~4 MiB."""
    from kvdi.connectors.cpu_offload import SAVE_BATCH_BYTES

    store = pool(8)
    assert store.save_batch_blocks == max(1, SAVE_BATCH_BYTES // FRAME)
    store.save_batch_blocks = 3  # as if each frame were 4 MiB / 3
    calls: list[int] = []
    put_many = store.put_many
    store.put_many = lambda items: calls.append(len(items)) or put_many(items)  # type: ignore[method-assign]
    engine = Engine(store, LAYOUT, make_settings(), seed=2)
    engine.worker._chunk = 1  # as if each block were CHUNK_BYTES: one block per call without a batch
    engine.prefill(PROMPT, (1, 2, 3, 4, 5))
    assert calls == [3, 1] and engine.worker.stats.saved_blocks == 4
