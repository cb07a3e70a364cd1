"""A store connector's quiet engine step costs a call per hook, and skips nothing that is due: lookups queued between
steps are flushed, staging of ended requests dropped, the prefill sample taken, the rule's probes counted, finished
jobs reported and the worker's gauges read again whenever its work moved. Calls are counted with ``sys.setprofile``
(deterministic, no timing)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kvdi.connectors.base import KVRequest, SchedulerOutput
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store import StoreTransferMetadata
from kvdi.connectors.store.deadline import MIN_STEP_TOKENS
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.transfer_queue import Outcome, TransferQueue
from kvdi.integrations.vllm.fleet.store_metrics import StoreCounters
from tests.helpers.calls import calls
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))  # 4 full blocks and 2 tokens
BLOCKS = (1, 2, 3, 4, 5)
QUIET = SchedulerOutput(0, ())
INFLIGHT = "g|worker|0-0|inflight_bytes|"


class GatedStore(DictStore):
    """A DictStore whose writes wait for ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Any]]]) -> int:
        self.gate.wait(10)
        return super().put_many(items)


def prefill_step(engine: Engine, req: KVRequest = PROMPT) -> StoreTransferMetadata:
    """One prefill step of ``req`` on both halves (:meth:`Engine.step`: asynchronous saves stay queued)."""
    return engine.step(req, BLOCKS)


def test_a_quiet_step_after_a_plan_is_answered_in_one_call_with_the_empty_metadata() -> None:
    for async_save in (True, False):
        engine = Engine(DictStore(), LAYOUT, make_settings(transfer={"async_save": async_save}), seed=1)
        prefill_step(engine)
        engine.worker.flush()
        n, meta = calls(engine.scheduler.build_connector_meta, QUIET)
        assert meta == StoreTransferMetadata(async_save=async_save) and n == 1
        assert calls(engine.scheduler.build_connector_meta, QUIET)[0] == 1


def test_the_half_says_when_a_quiet_step_has_something_to_plan() -> None:
    """``due`` (read by the vLLM adapter, which answers a quiet step for the half while it is False): set by a lookup,
    an allocation, a finished request and a step long enough to be a prefill sample; cleared by the next plan."""
    engine = Engine(DictStore(), LAYOUT, make_settings(), seed=1)
    sched = engine.scheduler
    prefill_step(engine)
    sched.build_connector_meta(QUIET)
    assert not sched.due
    for touch in (
        lambda: sched.get_num_new_matched_tokens(request(range(8), rid="x"), 0),
        lambda: sched.update_state_after_alloc(request(range(8), rid="x"), (1, 2), 0),
        lambda: sched.request_finished(request(range(8), rid="x"), []),
        lambda: prefill_step(engine, request(range(100, 102 + MIN_STEP_TOKENS), rid="long")),  # a sample to close
    ):
        touch()
        assert sched.due
        sched.build_connector_meta(QUIET)
        assert not sched.due


def test_a_step_after_a_long_one_takes_the_prefill_sample_and_the_next_quiet_one_does_not() -> None:
    engine = Engine(DictStore(), LAYOUT, make_settings(), seed=1)
    ticks = iter(range(1000))
    model = engine.scheduler.deadline.model
    model.clock = lambda: float(next(ticks))
    prefill_step(engine, request(range(MIN_STEP_TOKENS + 2)))  # a step long enough to be a prefill sample
    assert model.prefill.value is None
    engine.scheduler.build_connector_meta(QUIET)  # closes it: its tokens over the time since
    assert model.prefill.value == MIN_STEP_TOKENS + 2
    assert calls(engine.scheduler.build_connector_meta, QUIET)[0] == 1


def test_the_rules_probes_are_counted_on_a_quiet_step() -> None:
    engine = Engine(DictStore(), LAYOUT, make_settings(scheduler={"load_deadline": True}), seed=1)
    prefill_step(engine)
    assert engine.scheduler.deadline.probe() is not None  # a round-trip probe answered (a background thread's)
    engine.scheduler.build_connector_meta(QUIET)
    assert engine.scheduler.stats.deadline_probes == 1


def test_a_lookup_asked_for_between_steps_is_flushed_by_the_next_quiet_step() -> None:
    store = DictStore()
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)
    settings = make_settings(scheduler={"lookup": "async"}, transfer={"async_load": "off"})
    engine = Engine(store, LAYOUT, settings, seed=2)
    sched = engine.scheduler
    assert sched.enable_lookups() and sched.lookups is not None
    try:
        prefill_step(engine, request(range(8), rid="other"))  # a plan: nothing left due
        assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)  # queued in the background
        sched.build_connector_meta(QUIET)
        deadline = time.monotonic() + 10
        while sched.lookups.pending and time.monotonic() < deadline:
            sched.lookups.wait(0.5)
        assert sched.lookups.pending == 0 and sched.get_num_new_matched_tokens(PROMPT, 0) == (16, False)
    finally:
        sched.shutdown()


def test_the_staging_of_a_request_ended_between_steps_is_dropped_by_the_next_quiet_step() -> None:
    store = DictStore()
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)
    engine = Engine(store, LAYOUT, make_settings(transfer={"async_load": "prefetch"}), seed=2)
    assert engine.scheduler.enable_prefetch()
    assert engine.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (None, False)  # a prefetch instead
    meta = engine.scheduler.build_connector_meta(QUIET)
    assert isinstance(meta, StoreTransferMetadata) and meta.prefetches
    engine.worker.bind_connector_metadata(meta)
    assert engine.scheduler.request_finished(PROMPT, []) == (False, None)
    meta = engine.scheduler.build_connector_meta(QUIET)
    assert isinstance(meta, StoreTransferMetadata) and meta.prefetch_drops == ("r",)
    engine.worker.bind_connector_metadata(meta)
    assert engine.worker.staging is not None and not engine.worker.staging.requests
    assert calls(engine.scheduler.build_connector_meta, QUIET)[0] == 1


def test_an_idle_worker_answers_get_finished_and_prefetch_reports_in_one_call_each() -> None:
    engine = Engine(DictStore(), LAYOUT, make_settings(transfer={"async_load": "prefetch"}), seed=1)
    prefill_step(engine)
    engine.worker.flush()
    assert engine.worker.get_finished({"r"}) == ({"r"}, None)  # its saves were asynchronous: held, now done
    assert calls(engine.worker.get_finished, set()) == (1, (None, None))
    assert calls(engine.worker.get_finished, {"gone"}) == (1, (None, None))  # no job held for it
    assert calls(engine.worker.prefetch_reports) == (1, [])


def test_a_job_finishing_during_a_harvest_is_collected_by_the_next_one() -> None:
    class FinishesWhileAsked(Future[Outcome]):
        """Not done when first asked, done from then on (the job ended while the harvest looked)."""

        asked = False

        def done(self) -> bool:
            was, self.asked = self.asked, True
            return was

    queue = TransferQueue("t", 1 << 20)
    for rid in ("done", "late"):
        queue.submit_save(rid, 8, (1,), lambda rid=rid: Outcome(rid, False))
    queue.wait()
    late = FinishesWhileAsked()
    late.set_result(Outcome("late", False))
    queue.jobs[1].future = late
    assert [o.request_id for o in queue.harvest()] == ["done"]
    assert [o.request_id for o in queue.harvest()] == ["late"] and not queue.jobs
    queue.shutdown()


def test_the_worker_gauges_are_read_when_its_work_moves_and_not_on_quiet_steps() -> None:
    store = GatedStore()
    engine = Engine(store, LAYOUT, make_settings(transfer={"async_load": "off"}), seed=1)  # asynchronous saves
    worker, counters = engine.worker, StoreCounters("worker", "0-0", engine.worker, [])
    assert counters.entry(None) == {INFLIGHT: 0.0}
    assert calls(counters.entry, None) == (1, None)  # quiet: no gauge read
    prefill_step(engine)  # its saves wait for the gate
    worker.get_finished(set())
    assert counters.entry(None) == {INFLIGHT: 4.0 * LAYOUT.block_bytes}
    store.gate.set()
    worker.flush()  # done and collected: the gauge falls back without a counter passed in
    assert counters.entry(None) == {INFLIGHT: 0.0}
    worker.get_finished(set())
    assert calls(counters.entry, None) == (1, None)


def test_the_store_size_gauge_follows_the_workers_saves(tmp_path: Path) -> None:
    store = FileBlockStore(tmp_path / "kv", max_bytes=1 << 20)
    engine = Engine(store, LAYOUT, make_settings(transfer={"async_save": False, "async_load": "off"}), seed=1)
    counters = StoreCounters("worker", "0-0", engine.worker, [store])
    first = counters.entry(None) or {}
    assert first["g|worker|0-0|store_bytes|disk"] == 0.0
    assert calls(counters.entry, None) == (1, None)
    prefill_step(engine)  # written in the step: the gauge is read again, without a counter passed in
    assert (counters.entry(None) or {})["g|worker|0-0|store_bytes|disk"] == float(store.stored_bytes or 0) > 0
    assert counters.entry(None) is None


def test_the_staged_bytes_gauge_follows_a_prefetch_until_its_staging_is_dropped() -> None:
    store = DictStore()
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)
    engine = Engine(store, LAYOUT, make_settings(transfer={"async_load": "prefetch"}), seed=2)
    assert engine.scheduler.enable_prefetch()
    worker, counters = engine.worker, StoreCounters("worker", "0-0", engine.worker, [])
    staged = "g|worker|0-0|prefetch_staged_bytes|"
    assert (counters.entry(None) or {})[staged] == 0.0
    assert engine.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
    worker.bind_connector_metadata(engine.scheduler.build_connector_meta(QUIET))  # the prefetch starts
    assert (counters.entry(None) or {})[staged] == 4.0 * (LAYOUT.block_bytes + HEADER_SIZE)
    assert worker.staging is not None and worker.staging.wait(10)
    engine.scheduler.prefetched(worker.prefetch_reports())
    assert worker.prefetch_reports() == []  # reported once; the staging is held for the load
    assert engine.scheduler.request_finished(PROMPT, []) == (False, None)
    worker.bind_connector_metadata(engine.scheduler.build_connector_meta(QUIET))  # the drop
    assert counters.entry(None) == {staged: 0.0}
    assert worker.prefetch_reports_due  # the vLLM adapter asks for reports only while this is set
    worker.prefetch_reports()  # nothing staged any more: the last report (and gauge read), then quiet
    assert counters.entry(None) is None and not worker.prefetch_reports_due
    assert calls(worker.prefetch_reports) == (1, []) and calls(counters.entry, None) == (1, None)
