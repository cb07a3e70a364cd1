"""A background load already writing into KV blocks, past its deadline (``scheduler.load_deadline``, issue 34): the
scheduler half cancels it, the worker half reports its request finished receiving with every block failed (vLLM
recomputes it, counted ``deadline_recomputes``), no byte the store sends later lands in a block, and nothing is left
behind (guards, reports). Deterministic: an injected clock, a slow store double (a gate), the halves driven by hand."""

from __future__ import annotations

import threading

import pytest
import torch

from kvdi.connectors.base import ScheduledRequest, SchedulerOutput
from kvdi.connectors.store import StoreTransferMetadata
from kvdi.testing.redis_server import RedisServer
from tests.connectors.test_deadline import BLOCKS, LAYOUT, PROMPT, Clock, CountingStore, _consumer, _stored
from tests.connectors.test_deadline_redis import redis_store
from tests.helpers.store import Engine, make_settings

LOADED = BLOCKS[:4]  # 16 tokens: 4 blocks of 4


def _sent(store: CountingStore, clock: Clock) -> tuple[Engine, StoreTransferMetadata]:
    """A consumer whose background load of PROMPT's hit is running, stuck in the store (its gate closed)."""
    _stored(store)
    consumer = _consumer(store, clock, async_load="on")  # 16 tokens: 16 ms to recompute, the deadline 20 ms
    sched = consumer.scheduler
    store.gate = threading.Event()
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (16, True)
    sched.update_state_after_alloc(PROMPT, BLOCKS, 16)
    meta = sched.build_connector_meta(SchedulerOutput(1, ()))
    assert isinstance(meta, StoreTransferMetadata) and len(meta.async_loads) == 1 and not meta.load_cancels
    consumer.worker.bind_connector_metadata(meta)
    consumer.worker.start_load_kv()
    consumer.worker.clear_connector_metadata()
    return consumer, meta


def test_a_background_load_past_its_deadline_is_cancelled_reported_failed_and_its_late_bytes_never_land() -> None:
    store, clock = CountingStore(), Clock()
    consumer, _ = _sent(store, clock)
    sched, worker = consumer.scheduler, consumer.worker
    clock.now += 0.019
    assert not sched.build_connector_meta(SchedulerOutput(2, ())).load_cancels  # within its deadline: it runs on
    clock.now += 0.002
    meta = sched.build_connector_meta(SchedulerOutput(3, ()))
    assert isinstance(meta, StoreTransferMetadata) and meta.load_cancels == ("r",)
    assert sched.stats.deadline_recomputes == 1 and sched.deadline.suspect
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    assert worker.get_block_ids_with_load_errors() == set(LOADED)  # vLLM recomputes every block of the load
    assert worker.get_finished(set()) == (None, {"r"})  # at once: the store is still stuck
    worker.clear_connector_metadata()
    for cache in consumer.caches.values():  # vLLM recomputes into the request's blocks
        cache[list(LOADED)] = 7.0
    assert worker.get_finished({"r"}) == (None, None)  # finished: its blocks stay held while the job may run
    store.gate.set()  # the late bytes arrive
    worker.flush()
    assert all(bool((c[list(LOADED)] == 7.0).all()) for c in consumer.caches.values())  # none landed
    assert worker.get_finished(set()) == ({"r"}, None)  # then its blocks are given back; not received twice
    assert worker.stats.loaded_blocks == 0 and worker.cancels.cancelled == 1
    assert not worker.cancels._guards and not worker.cancels._cancelled  # nothing left behind


def test_a_background_load_within_its_deadline_lands_whole_and_is_not_cancelled() -> None:
    store, clock = CountingStore(), Clock()
    consumer, _ = _sent(store, clock)
    sched, worker = consumer.scheduler, consumer.worker
    store.gate.set()
    worker.flush()
    assert worker.get_finished(set()) == (None, {"r"}) and not worker.get_block_ids_with_load_errors()
    clock.now += 1.0  # vLLM resumes it: scheduled, its load ended; no cancel however late the clock
    meta = sched.build_connector_meta(SchedulerOutput(2, (ScheduledRequest(PROMPT, BLOCKS, 16, 2),)))
    assert isinstance(meta, StoreTransferMetadata) and not meta.load_cancels
    assert sched.stats.deadline_recomputes == 0 and worker.stats.loaded_blocks == 4
    assert not worker.cancels._guards


def test_a_cancel_that_reaches_a_finished_load_changes_nothing() -> None:
    store, clock = CountingStore(), Clock()
    consumer, _ = _sent(store, clock)
    worker = consumer.worker
    store.gate.set()
    worker.flush()  # the load ended just before its cancel arrived
    worker.bind_connector_metadata(StoreTransferMetadata(load_cancels=("r",)))
    assert worker.get_finished(set()) == (None, {"r"}) and not worker.get_block_ids_with_load_errors()
    assert worker.stats.loaded_blocks == 4 and worker.cancels.cancelled == 0


def test_with_the_rule_off_a_background_load_reads_into_the_blocks_as_before_and_is_never_cancelled() -> None:
    store, clock = CountingStore(), Clock()
    _stored(store)
    consumer = _consumer(store, clock, async_load="on")
    consumer.scheduler.deadline.enabled = False
    consumer.worker.cancels.enabled = False
    sched = consumer.scheduler
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (16, True)
    sched.update_state_after_alloc(PROMPT, BLOCKS, 16)
    sched.build_connector_meta(SchedulerOutput(1, ()))
    clock.now += 60.0
    assert not sched.build_connector_meta(SchedulerOutput(2, ())).load_cancels
    assert not sched.load_deadlines.running and torch.is_tensor(consumer.block(1)[0])


@pytest.mark.redis
def test_on_redis_a_cancelled_load_stalled_by_sigstop_reads_no_byte_into_the_blocks(redis_server: RedisServer) -> None:
    """Redis reads frames straight into the blocks (``get_into_many``) unless the load can be cancelled: then into
    host buffers, so the bytes a frozen server sends once it runs again never reach the blocks vLLM recomputes."""
    store = redis_store(redis_server.url)
    try:
        Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)
        clock = Clock()
        settings = make_settings(scheduler={"load_deadline": True, "lookup": "sync"}, transfer={"async_load": "on"})
        consumer = Engine(store, LAYOUT, settings, seed=2)
        sched, worker = consumer.scheduler, consumer.worker
        assert worker.capabilities.read_into
        sched.deadline.model.clock = clock
        sched.deadline.model.prefill.add(1000.0)
        assert sched.get_num_new_matched_tokens(PROMPT, 0) == (16, True)
        sched.update_state_after_alloc(PROMPT, BLOCKS, 16)
        redis_server.freeze()
        try:
            worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput(1, ())))
            worker.start_load_kv()  # the job's read hangs on the frozen server
            clock.now += 0.021
            meta = sched.build_connector_meta(SchedulerOutput(2, ()))
            assert isinstance(meta, StoreTransferMetadata) and meta.load_cancels == ("r",)
            worker.bind_connector_metadata(meta)
            assert worker.get_finished(set()) == (None, {"r"})
            assert worker.get_block_ids_with_load_errors() == set(LOADED)
            for cache in consumer.caches.values():
                cache[list(LOADED)] = 7.0  # recomputed
        finally:
            redis_server.thaw()
        worker.flush()  # the read returns with the stored bytes
        assert all(bool((c[list(LOADED)] == 7.0).all()) for c in consumer.caches.values())
        assert worker.stats.loaded_blocks == 0 and sched.stats.deadline_recomputes == 1
    finally:
        store.close()


def test_a_cancelled_load_s_request_computes_when_asked_again() -> None:
    store, clock = CountingStore(), Clock()
    consumer, _ = _sent(store, clock)
    sched = consumer.scheduler
    clock.now += 0.021
    assert sched.build_connector_meta(SchedulerOutput(2, ())).load_cancels == ("r",)
    sched.deadline.answered(1e-4)  # the store answers fast again: another request's hit would load
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)  # vLLM recomputes this one: no second load
    store.gate.set()
    consumer.worker.flush()
