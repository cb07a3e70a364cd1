"""The load deadline's cancel of background loads that issue 34's last round left open: a device cache's load (its
chunks copied in from staging on a side stream) and a request preempted after its cancel while the store call is
stuck. Deterministic: the slow store double (a gate), the halves driven by hand, a recording CUDA
(:mod:`kvdi.testing.cuda_recording`) standing in for the device: the copies really happen, on CPU tensors, and every
stream and event call is logged."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

import kvdi.connectors.store.blockio as blockio
from kvdi.connectors.base import SchedulerOutput
from kvdi.connectors.store import StoreTransferMetadata
from kvdi.connectors.store.blockio import CacheIOs
from kvdi.connectors.store.transfer_queue import Outcome
from kvdi.connectors.streams import StreamOrder
from kvdi.testing.cuda_recording import RecordingCuda
from tests.connectors.test_deadline import BLOCKS, LAYOUT, PROMPT, Clock, CountingStore, _consumer, _stored
from tests.helpers.store import Engine

LOADED = BLOCKS[:4]  # 16 tokens: 4 blocks of 4


class SecondReadStalls(CountingStore):
    """The first ``get_many`` answers; the later ones wait for ``gate`` (a store that stalls mid-load)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        self.reads += 1
        if self.reads > 1 and self.gate is not None:
            self.gate.wait(10)
        return super(CountingStore, self).get_many(keys)


def _on_device(consumer: Engine, cuda: RecordingCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's caches as a device cache: staged chunks of 2 blocks, copies ordered by the recording CUDA."""
    monkeypatch.setattr(blockio, "order_for", lambda device: StreamOrder("cuda:0", cuda))
    tensors = [consumer.caches[n] for n in LAYOUT.layer_names]
    consumer.worker._ios = CacheIOs(tensors, LAYOUT.layer_block_bytes, 2, None, "t", staging=True, device_chunk=2)
    assert not consumer.worker._ios.io.direct


def _sent(
    store: CountingStore, clock: Clock, cuda: RecordingCuda | None = None, monkeypatch: pytest.MonkeyPatch | None = None
) -> Engine:
    """A consumer (on a device cache when ``cuda`` is given) whose background load of PROMPT's hit runs; the
    store's gate closed."""
    _stored(store)
    consumer = _consumer(store, clock, async_load="on")  # 16 tokens: the deadline 20 ms
    if cuda is not None and monkeypatch is not None:
        _on_device(consumer, cuda, monkeypatch)
    sched, worker = consumer.scheduler, consumer.worker
    store.gate = threading.Event()
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (16, True)
    sched.update_state_after_alloc(PROMPT, BLOCKS, 16)
    worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput(1, ())))
    worker.start_load_kv()
    worker.clear_connector_metadata()
    return consumer


def _cancel(consumer: Engine, clock: Clock) -> None:
    clock.now += 0.021
    meta = consumer.scheduler.build_connector_meta(SchedulerOutput(2, ()))
    assert isinstance(meta, StoreTransferMetadata) and meta.load_cancels == ("r",)
    consumer.worker.bind_connector_metadata(meta)


def _recomputed(consumer: Engine) -> None:
    for cache in consumer.caches.values():
        cache[list(LOADED)] = 7.0


def _untouched(consumer: Engine) -> bool:
    return all(bool((c[list(LOADED)] == 7.0).all()) for c in consumer.caches.values())


def test_a_device_cache_s_load_stuck_in_the_store_is_cancelled_and_nothing_lands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, clock, cuda = CountingStore(), Clock(), RecordingCuda()
    consumer = _sent(store, clock, cuda, monkeypatch)  # every read waits: no chunk placed
    worker = consumer.worker
    _cancel(consumer, clock)
    assert worker.get_block_ids_with_load_errors() == set(LOADED)  # vLLM recomputes every block of the load
    assert worker.get_finished(set()) == (None, {"r"})  # at once: the store is still stuck
    assert not [e for e in cuda.log if e[0] == "wait_event" and e[1] == "compute"]  # nothing queued to wait for
    worker.clear_connector_metadata()
    _recomputed(consumer)
    store.gate.set()  # the late bytes arrive
    worker.flush()
    assert _untouched(consumer) and worker.stats.loaded_blocks == 0 and worker.cancels.cancelled == 1
    assert worker.get_finished(set()) == (None, None)  # its late outcome dropped: not received twice
    assert not worker.cancels._guards and not worker.cancels._cancelled


def test_a_device_cache_s_cancel_orders_the_engine_s_stream_after_the_copies_queued_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, clock, cuda = SecondReadStalls(), Clock(), RecordingCuda()
    consumer = _sent(store, clock, cuda, monkeypatch)
    worker = consumer.worker
    for _ in range(200):  # the first chunk's copies are queued once the second read is under way
        if store.reads >= 2:
            break
        threading.Event().wait(0.01)
    assert store.reads == 2
    placed = [e for e in cuda.log if e[0] == "scatter"]
    assert placed and all(e[1] == "side1" for e in placed)  # the first chunk: into its blocks, on the side stream
    _cancel(consumer, clock)
    after = [e for e in cuda.log if e[0] == "record" and e[2] == "side1"][-1][1]  # the event after those copies
    assert ("wait_event", "compute", after) in cuda.log  # the engine's stream (the recompute) follows them
    assert not [e for e in cuda.log if e[0] == "host_wait" and e[2] == "compute"]  # the host never waits
    assert worker.get_block_ids_with_load_errors() == set(LOADED)
    worker.clear_connector_metadata()
    _recomputed(consumer)
    scatters = len([e for e in cuda.log if e[0] == "scatter"])
    store.gate.set()
    worker.flush()
    assert len([e for e in cuda.log if e[0] == "scatter"]) == scatters  # no copy queued after the cancel
    assert _untouched(consumer) and worker.stats.loaded_blocks == 0


def test_a_request_preempted_after_its_cancel_does_not_wait_for_the_stuck_store_call() -> None:
    store, clock = CountingStore(), Clock()
    consumer = _sent(store, clock)
    worker = consumer.worker
    assert store.gate is not None
    saving = threading.Event()

    def save() -> Outcome:  # another request's save, still running: a preempted request's saves are waited for
        saving.wait(10)
        return Outcome("s", False)

    worker._queue.submit_save("s", 0, (9,), save)
    _cancel(consumer, clock)
    assert worker.get_finished(set()) == (None, {"r"})
    jobs = worker._queue.jobs
    assert worker.cancels.preempted_jobs(jobs, {"r", "s"}) == [j.future for j in jobs if j.request_id == "s"]
    preempted = threading.Thread(target=worker.handle_preemptions, args=({"r"},), daemon=True)
    preempted.start()
    preempted.join(10)
    stuck = preempted.is_alive()
    saving.set()
    store.gate.set()  # the store call returns: nothing of it lands, its outcome is dropped
    preempted.join(10)
    assert not stuck, "the preemption hook waited for the cancelled load's stuck store call"
    worker.flush()
    assert worker.stats.loaded_blocks == 0 and worker.get_finished(set()) == (None, None)
    assert not worker.cancels._guards and not worker.cancels._cancelled
