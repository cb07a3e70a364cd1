"""The generic store halves: what the scheduler half plans and what the worker half moves."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvdi.connectors.base import (
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorRole,
    ScheduledRequest,
    SchedulerOutput,
)
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store import StoreSchedulerConnector, StoreWorkerConnector
from kvdi.connectors.store.keys import block_keys
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))  # 4 full blocks and 2 tokens


@pytest.fixture(params=[False, True], ids=["inline", "io-thread"])
def io_thread(request: pytest.FixtureRequest) -> bool:
    """Run a transfer test with the worker's store calls inline and on its I/O thread."""
    return bool(request.param)


@pytest.fixture
def store(tmp_path: Path) -> FileBlockStore:
    return FileBlockStore(tmp_path / "kv")


def producer_then(store: object, role: str = "kv_both", prompt: object = PROMPT) -> Engine:
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(prompt, (1, 2, 3, 4, 5))  # type: ignore[arg-type]
    return Engine(store, LAYOUT, make_settings(role=role))  # type: ignore[arg-type]


def test_consumer_is_offered_the_leading_stored_blocks(store: FileBlockStore) -> None:
    engine = producer_then(store)
    assert engine.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (16, False)
    assert (engine.scheduler.stats.lookups, engine.scheduler.stats.lookup_hit_blocks) == (1, 4)


def test_offer_leaves_the_last_prompt_token_to_compute(store: FileBlockStore) -> None:
    whole_blocks = request(range(16))
    engine = producer_then(store, prompt=whole_blocks)
    assert engine.scheduler.get_num_new_matched_tokens(whole_blocks, 0) == (12, False)


def test_offer_stops_at_the_first_missing_block(store: FileBlockStore) -> None:
    engine = producer_then(store)
    store.discard(block_keys(PROMPT.prompt_token_ids, LAYOUT)[2])
    assert engine.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (8, False)


def test_offer_excludes_tokens_already_computed(store: FileBlockStore) -> None:
    engine = producer_then(store)
    assert engine.scheduler.get_num_new_matched_tokens(PROMPT, 8) == (8, False)


def test_producer_only_is_never_offered_tokens(store: FileBlockStore) -> None:
    engine = producer_then(store, role="kv_producer")
    assert engine.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (0, False)


def test_consumer_only_never_saves(store: FileBlockStore) -> None:
    engine = Engine(store, LAYOUT, make_settings(role="kv_consumer"), seed=1)
    engine.prefill(PROMPT, (1, 2, 3, 4, 5))
    assert engine.worker.stats.saved_blocks == 0
    assert store.count_prefix(block_keys(PROMPT.prompt_token_ids, LAYOUT)) == 0


def test_different_salt_is_a_miss(store: FileBlockStore) -> None:
    engine = producer_then(store)
    assert engine.scheduler.get_num_new_matched_tokens(request(range(18), salt="tenant-b"), 0) == (0, False)


def test_load_plan_names_block_ids_and_keys_of_the_loaded_prefix(store: FileBlockStore) -> None:
    engine = producer_then(store)
    n, _ = engine.scheduler.get_num_new_matched_tokens(PROMPT, 0)
    engine.scheduler.update_state_after_alloc(PROMPT, (9, 8, 7, 6, 5), n)
    meta = engine.scheduler.build_connector_meta(SchedulerOutput(1, (ScheduledRequest(PROMPT, (9, 8, 7, 6, 5), n, 2),)))
    assert isinstance(meta, BlockTransferMetadata)
    (load,) = meta.loads
    assert load.block_ids == (9, 8, 7, 6)
    assert load.block_keys == tuple(block_keys(PROMPT.prompt_token_ids, LAYOUT)[:4])
    assert meta.saves == ()


def test_declined_offer_loads_nothing(store: FileBlockStore) -> None:
    engine = producer_then(store)
    engine.scheduler.get_num_new_matched_tokens(PROMPT, 0)
    engine.scheduler.update_state_after_alloc(PROMPT, (1, 2, 3, 4, 5), 0)
    meta = engine.scheduler.build_connector_meta(
        SchedulerOutput(1, (ScheduledRequest(PROMPT, (1, 2, 3, 4, 5), 0, 18),))
    )
    assert isinstance(meta, BlockTransferMetadata) and meta.loads == ()


def test_chunked_prefill_saves_each_block_once_when_it_completes(store: FileBlockStore) -> None:
    engine = Engine(store, LAYOUT, make_settings(), seed=1)
    engine.scheduler.get_num_new_matched_tokens(PROMPT, 0)
    engine.scheduler.update_state_after_alloc(PROMPT, (1, 2, 3, 4, 5), 0)
    saved = []
    for step, (start, n) in enumerate([(0, 6), (6, 6), (12, 6), (18, 1)], 1):
        sched = ScheduledRequest(PROMPT, (1, 2, 3, 4, 5), start, n)
        meta = engine.scheduler.build_connector_meta(SchedulerOutput(step, (sched,)))
        assert isinstance(meta, BlockTransferMetadata)
        saved.append([b for t in meta.saves for b in t.block_ids])
    assert saved == [[1], [2, 3], [4], []]


def test_loaded_blocks_are_not_saved_again(store: FileBlockStore) -> None:
    engine = producer_then(store, prompt=request(range(10)))
    n, errors = engine.prefill(PROMPT, (1, 2, 3, 4, 5))
    assert (n, errors) == (8, set())
    assert engine.worker.stats.saved_blocks == 2  # blocks 2 and 3 only


def test_round_trip_restores_every_byte(store: FileBlockStore, io_thread: bool) -> None:
    producer = Engine(store, LAYOUT, make_settings(), seed=7, io_thread=io_thread)
    producer.prefill(PROMPT, (1, 2, 3, 4, 5))
    consumer = Engine(store, LAYOUT, make_settings(), io_thread=io_thread)
    assert consumer.prefill(PROMPT, (10, 11, 12, 13, 14)) == (16, set())
    for src, dst in zip((1, 2, 3, 4), (10, 11, 12, 13), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(producer.block(src), consumer.block(dst), strict=True))
    assert consumer.worker.stats.loaded_bytes == 4 * LAYOUT.block_bytes == producer.worker.stats.saved_bytes


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_round_trip_through_a_store_without_read_into(dtype: str) -> None:
    layout = small_layout(dtype=dtype)
    store = DictStore()
    producer = Engine(store, layout, make_settings(), seed=3)
    producer.prefill(PROMPT, (1, 2, 3, 4, 5))
    consumer = Engine(store, layout, make_settings())
    assert consumer.prefill(PROMPT, (6, 7, 8, 9, 10)) == (16, set())
    assert torch.equal(torch.stack(producer.block(2)), torch.stack(consumer.block(7)))


def test_block_gone_before_load_is_a_load_failure_from_that_block_on(store: FileBlockStore, io_thread: bool) -> None:
    engine = producer_then(store)
    engine.worker.io_thread = io_thread
    n, _ = engine.scheduler.get_num_new_matched_tokens(PROMPT, 0)
    os.unlink(store.path_for(block_keys(PROMPT.prompt_token_ids, LAYOUT)[1]))
    engine.scheduler.update_state_after_alloc(PROMPT, (1, 2, 3, 4, 5), n)
    meta = engine.scheduler.build_connector_meta(SchedulerOutput(1, (ScheduledRequest(PROMPT, (1, 2, 3, 4, 5), n, 2),)))
    engine.worker.bind_connector_metadata(meta)
    engine.worker.start_load_kv()
    assert engine.worker.get_block_ids_with_load_errors() == {2, 3, 4}
    assert (engine.worker.stats.load_failures, engine.worker.stats.loaded_blocks) == (1, 1)


def test_an_unreadable_object_is_a_counted_drop_not_an_exception(store: FileBlockStore, io_thread: bool) -> None:
    engine = producer_then(store)
    engine.worker.io_thread = io_thread
    n, _ = engine.scheduler.get_num_new_matched_tokens(PROMPT, 0)
    path = store.path_for(block_keys(PROMPT.prompt_token_ids, LAYOUT)[0])
    os.unlink(path)
    os.symlink(path.name, path)  # a symlink loop: O_NOFOLLOW refuses it (ELOOP)
    engine.scheduler.update_state_after_alloc(PROMPT, (1, 2, 3, 4, 5), n)
    meta = engine.scheduler.build_connector_meta(SchedulerOutput(1, (ScheduledRequest(PROMPT, (1, 2, 3, 4, 5), n, 2),)))
    engine.worker.bind_connector_metadata(meta)
    engine.worker.start_load_kv()
    assert engine.worker.get_block_ids_with_load_errors() == {1, 2, 3, 4}
    # the odd object is dropped and counted once; the ones after it were not tried
    assert (engine.worker.stats.corrupt_dropped, engine.worker.stats.load_failures) == (1, 0)
    assert not os.path.lexists(path)


def test_write_error_is_a_save_failure_not_an_exception(tmp_path: Path, io_thread: bool) -> None:
    store = FileBlockStore(tmp_path / "kv")
    (tmp_path / "kv").write_bytes(b"not a directory")
    engine = Engine(store, LAYOUT, make_settings(), seed=1, io_thread=io_thread)
    assert engine.prefill(PROMPT, (1, 2, 3, 4, 5)) == (0, set())
    assert (engine.worker.stats.save_failures, engine.worker.stats.saved_blocks) == (4, 0)


def test_cache_of_another_layout_is_rejected(store: FileBlockStore) -> None:
    engine = Engine(store, LAYOUT, make_settings())
    with pytest.raises(ValueError, match="does not match"):
        engine.worker.register_kv_caches({"layers.0": torch.zeros(4, 2, 8, 2, 8)})


def test_backend_must_be_a_block_store() -> None:
    ctx = ConnectorContext("x", KVConnectorRole.WORKER, make_settings(), LAYOUT, None, object())
    with pytest.raises(TypeError, match="BlockStore"):
        StoreWorkerConnector(ctx)
    with pytest.raises(TypeError, match="BlockStore"):
        StoreSchedulerConnector(ctx)


def test_staged_copies_move_the_same_bytes_as_direct_ones() -> None:
    from kvdi.connectors.store.blockio import CacheIO

    src = [torch.randn(6, *LAYOUT.block_shape) for _ in range(LAYOUT.num_layers)]
    dst = [torch.zeros_like(t) for t in src]
    staged_src = CacheIO(src, LAYOUT.layer_block_bytes, chunk=2, staging=True)
    staged_dst = CacheIO(dst, LAYOUT.layer_block_bytes, chunk=2, staging=True)
    (pieces,) = staged_src.save_pieces([4])
    payload = b"".join(bytes(p) for p in pieces)
    assert len(payload) == LAYOUT.block_bytes
    staged_dst.copy_payload(memoryview(payload), staged_dst.load_pieces(0, 1))
    staged_dst.commit_load(0, 1)
    staged_dst.finish()
    assert all(torch.equal(a[4], b[1]) for a, b in zip(src, dst, strict=True))


def test_transfers_larger_than_one_chunk_round_trip(tmp_path: Path, io_thread: bool) -> None:
    big = small_layout(block_size=64, num_layers=64)  # 512 KiB blocks: several store calls per request
    store = FileBlockStore(tmp_path / "kv")
    prompt = request(range(64 * 6 + 1))
    producer = Engine(store, big, make_settings(), num_blocks=8, seed=2, io_thread=io_thread)
    producer.prefill(prompt, tuple(range(7)))
    consumer = Engine(store, big, make_settings(), num_blocks=8, io_thread=io_thread)
    assert consumer.prefill(prompt, (7, 6, 5, 4, 3, 2, 1)) == (6 * 64, set())
    assert torch.equal(torch.stack(producer.block(5)), torch.stack(consumer.block(2)))


def test_a_bad_block_in_a_later_chunk_reports_from_that_block_on(tmp_path: Path, io_thread: bool) -> None:
    big = small_layout(block_size=64, num_layers=64)
    store = FileBlockStore(tmp_path / "kv")
    prompt = request(range(64 * 6 + 1))
    Engine(store, big, make_settings(), num_blocks=8, seed=2).prefill(prompt, tuple(range(7)))
    path = store.path_for(block_keys(prompt.prompt_token_ids, big)[4])
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    consumer = Engine(store, big, make_settings(), num_blocks=8, io_thread=io_thread)
    assert consumer.prefill(prompt, (7, 6, 5, 4, 3, 2, 1)) == (6 * 64, {3, 2})
    assert (consumer.worker.stats.loaded_blocks, consumer.worker.stats.corrupt_dropped) == (4, 1)


def test_a_stored_last_block_is_not_offered_nor_saved_again(store: FileBlockStore) -> None:
    whole_blocks = request(range(16))
    engine = producer_then(store, prompt=whole_blocks)
    assert engine.prefill(whole_blocks, (1, 2, 3, 4, 5)) == (12, set())
    assert engine.worker.stats.saved_blocks == 0
