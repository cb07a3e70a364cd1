"""The load deadline's cost model and rule (``scheduler.load_deadline``), deterministic: an injected clock and
estimates set by hand, the store halves driven step by step as the vLLM adapter drives them (no timing asserts)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from kvdi.connectors.base import ConnectorStats, ScheduledRequest, SchedulerOutput
from kvdi.connectors.store import StoreTransferMetadata
from kvdi.connectors.store.deadline import (
    MIN_DEADLINE_S,
    PROBE_INTERVAL_S,
    CostModel,
    DeadlineRule,
    DeadlineStats,
    Ewma,
)
from kvdi.errors import ConfigError
from kvdi.settings import load_settings
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))  # 4 full blocks and 2 tokens: 16 tokens loadable
BLOCKS = (1, 2, 3, 4, 5)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountingStore(DictStore):
    """A DictStore that counts lookups and reads; with ``gate`` set, reads wait for it (a stalled store)."""

    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0
        self.gate: threading.Event | None = None
        self.lookup_gate: threading.Event | None = None

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        self.lookups += 1
        if self.lookup_gate is not None:
            self.lookup_gate.wait(10)
        return super().count_prefix(keys)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        if self.gate is not None:
            self.gate.wait(10)
        return super().get_many(keys)


def test_an_estimate_starts_at_its_first_sample_clamps_and_moves_by_alpha() -> None:
    e = Ewma(1.0, 100.0, alpha=0.5)
    assert e.add(10.0) == 10.0
    assert e.add(20.0) == 15.0
    assert e.add(1e9) == 57.5  # clamped to 100 first
    assert e.add(0.0, replace=True) == 1.0 and e.samples == 4


def test_the_prefill_rate_comes_from_prefill_steps_only() -> None:
    clock = Clock()
    model = CostModel(clock)
    model.step(1000)
    clock.now += 0.5
    model.step(4)  # the 1000-token step took 0.5 s: 2000 tokens/s
    assert model.prefill.value == 2000.0
    clock.now += 0.01
    model.step(500)  # the 4-token decode step is no prefill sample: it is the fixed part of a step, 10 ms
    clock.now += 3600
    model.step(0)  # an hour idle after a step is not one
    assert model.prefill.samples == 1 and model.overhead.value == pytest.approx(0.01)
    assert model.recompute_s(1000) == pytest.approx(0.51) and model.recompute_s(0) == 0.0


def test_the_throughput_is_what_a_waiting_request_saw_less_a_round_trip() -> None:
    model = CostModel(Clock())
    assert model.load_s(1 << 20) is None  # nothing measured
    model.round_trip(0.01)
    model.transfer(1_000_000, 0.11)  # 0.1 s beyond the round trip
    assert model.throughput.value == pytest.approx(1e7)
    assert model.load_s(2_000_000) == pytest.approx(0.01 + 0.2)


def _rule(enabled: bool = True, margin: float = 1.0) -> DeadlineRule:
    return DeadlineRule(DictStore(), "t", DeadlineStats(), enabled=enabled, margin=margin, clock=Clock())


def test_until_the_prefill_rate_is_measured_the_rule_refuses_nothing() -> None:
    rule = _rule()
    rule.model.round_trip(60.0)
    rule.model.throughput.add(1e3)
    assert not rule.skip_lookup(1) and rule.offer(1, 1 << 30) and rule.deadline_s(1) == float("inf")
    assert rule.stats.lookups_skipped == rule.stats.deadline_refused == 0


def test_a_lookup_whose_round_trip_costs_more_than_recompute_is_skipped_and_counted() -> None:
    rule = _rule(margin=2.0)
    rule.model.prefill.add(1000.0)  # 1 ms a token
    rule.model.round_trip(0.05)
    rule._probe_at = rule.clock()  # no probe due now
    assert not rule.skip_lookup(25)  # 50 ms <= 2 x 25 ms
    assert rule.skip_lookup(24) and rule.stats.lookups_skipped == 1
    assert not _rule(enabled=False).skip_lookup(0)


def test_a_hit_is_offered_only_when_loading_it_beats_recomputing_it() -> None:
    rule = _rule()
    rule.model.prefill.add(1000.0)
    rule.model.round_trip(0.001)
    rule.model.throughput.add(1e6)  # 1 MB/s
    assert rule.offer(100, 50_000)  # 51 ms <= 100 ms
    assert not rule.offer(100, 200_000) and rule.stats.deadline_refused == 1  # 201 ms > 100 ms
    rule.model.round_trip(0.01, replace=True)
    assert rule.deadline_s(100) == pytest.approx(0.04)  # 4 round trips, sooner than the 100 ms budget
    rule.model.round_trip(0.001, replace=True)
    assert rule.deadline_s(100, 50_000) == pytest.approx(0.1)  # 4 x 51 ms: the budget is sooner
    assert rule.deadline_s(100, 10_000) == pytest.approx(4 * 0.011) and rule.deadline_s(1) == MIN_DEADLINE_S


def test_an_overrun_raises_the_round_trip_and_a_probe_brings_it_back() -> None:
    rule = _rule()
    rule.model.prefill.add(1000.0)
    rule.model.round_trip(0.001)
    rule.overran("prefetch", 16, 3.0)
    assert rule.stats.deadline_recomputes == 1 and rule.model.rtt.value == 3.0
    rule._probe_at = rule.clock()
    assert rule.skip_lookup(16)  # the stalled store is not asked
    seconds = rule.probe()  # the store answers again (a dict: microseconds)
    assert seconds is not None and rule.model.rtt.value == max(seconds, 1e-6)
    rule.step(0)
    assert rule.stats.deadline_probes == 2 and not rule.skip_lookup(16)  # its first answer, far below 1 ms: asked again


def test_a_probe_runs_in_the_background_at_most_once_per_interval() -> None:
    store = CountingStore()
    store.lookup_gate = threading.Event()  # the probe is in flight until set
    rule = DeadlineRule(store, "t", DeadlineStats(), enabled=True, clock=(clock := Clock()))
    rule.model.prefill.add(1000.0)
    rule.model.at_least(1.0)  # a wait overran: lookups are skipped until the store answers faster
    assert rule.skip_lookup(16) and rule.skip_lookup(16)  # one probe for two skips
    store.lookup_gate.set()
    for _ in range(1000):
        if not rule._probing:
            break
        threading.Event().wait(0.01)
    assert store.lookups == 1 and not rule._probing
    assert not rule.skip_lookup(16)  # the probe answered fast: the store is asked again
    rule.model.at_least(1.0)
    assert rule.skip_lookup(16) and store.lookups == 1  # skipped again within the interval: no probe
    clock.now += PROBE_INTERVAL_S
    assert rule.skip_lookup(16)
    for _ in range(1000):
        if store.lookups == 2 and not rule._probing:
            break
        threading.Event().wait(0.01)
    assert store.lookups == 2


def _consumer(store: DictStore, clock: Clock, **transfer: object) -> Engine:
    settings = make_settings(scheduler={"load_deadline": True}, transfer={"async_load": "prefetch", **transfer})
    engine = Engine(store, LAYOUT, settings, seed=2)
    engine.scheduler.deadline.model.clock = clock
    engine.scheduler.deadline.model.prefill.add(1000.0)  # 16 tokens: 16 ms to recompute, the deadline 20 ms
    assert engine.scheduler.enable_prefetch() == (engine.settings.transfer.async_load == "prefetch")
    return engine


def _stored(store: DictStore) -> None:
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)


def test_a_prefetch_past_its_deadline_is_abandoned_its_staging_dropped_and_the_request_computes() -> None:
    store, clock = CountingStore(), Clock()
    _stored(store)
    consumer = _consumer(store, clock)
    sched = consumer.scheduler
    store.gate = threading.Event()  # the store stalls mid-load
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
    meta = sched.build_connector_meta(SchedulerOutput(1, ()))
    assert isinstance(meta, StoreTransferMetadata) and len(meta.prefetches) == 1
    consumer.worker.bind_connector_metadata(meta)
    clock.now += 0.019
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)  # within its deadline: wait
    clock.now += 0.002
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)  # past it: recompute, never waited for
    assert sched.stats.deadline_recomputes == 1 and sched.stats.load_failures == 0
    assert sched.deadline.model.rtt.value is not None and sched.deadline.model.rtt.value >= 0.02
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)  # asked again: still computes
    sched.update_state_after_alloc(PROMPT, BLOCKS, 0)
    meta = sched.build_connector_meta(SchedulerOutput(2, (ScheduledRequest(PROMPT, BLOCKS, 0, 18),)))
    assert isinstance(meta, StoreTransferMetadata) and meta.prefetch_drops == ("r",) and meta.loads == ()
    before = [consumer.block(b) for b in BLOCKS]
    consumer.worker.bind_connector_metadata(meta)
    consumer.worker.start_load_kv()
    store.gate.set()  # the late bytes arrive
    staging = consumer.worker.staging
    assert staging is not None
    staging.shutdown()  # waits for the fetch
    assert consumer.worker.prefetch_reports() == [] and staging.held_bytes == 0 and staging.take("r") is None
    assert all(a.equal(b) for b_id, old in zip(BLOCKS, before, strict=True)
               for a, b in zip(consumer.block(b_id), old, strict=True))  # fmt: skip
    assert consumer.worker.stats.loaded_blocks == 0


def test_a_prefetch_reported_in_time_loads_and_measures_the_throughput() -> None:
    store, clock = CountingStore(), Clock()
    _stored(store)
    consumer = _consumer(store, clock)
    sched = consumer.scheduler
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
    meta = sched.build_connector_meta(SchedulerOutput(1, ()))
    consumer.worker.bind_connector_metadata(meta)
    assert consumer.worker.staging is not None and consumer.worker.staging.wait(10)
    clock.now += 0.01
    sched.prefetched(consumer.worker.prefetch_reports())
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (16, False)
    assert sched.deadline.model.throughput.samples == 1 and sched.stats.deadline_recomputes == 0


def test_a_skipped_lookup_asks_no_store_and_a_refused_hit_is_not_offered() -> None:
    store, clock = CountingStore(), Clock()
    _stored(store)
    consumer = _consumer(store, clock, async_load="off")
    sched = consumer.scheduler
    sched.deadline._probe_at = clock.now  # no probe due
    sched.deadline.model.round_trip(1.0)
    asked = store.lookups
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)
    assert store.lookups == asked and sched.stats.lookups_skipped == 1 and sched.stats.lookups == 0
    sched.deadline.model.round_trip(1e-6, replace=True)
    sched.deadline.joining = 0  # the next requests are alone in their step (a skipped one's recompute joins them)
    sched.deadline.model.throughput.add(4 * sched._block_bytes / 0.017)  # 4 blocks in 17 ms
    assert sched.get_num_new_matched_tokens(request(range(18), rid="s"), 0) == (0, False)  # asked: 17 ms < 18 ms
    assert sched.stats.deadline_refused == 1 and store.lookups == asked + 1  # not offered: 17 ms > 16 ms
    sched.deadline.joining = 0
    sched.deadline.model.throughput.add(1e3, replace=True)  # 1 kB/s: even a whole hit costs more than recompute
    assert sched.get_num_new_matched_tokens(request(range(18), rid="t"), 0) == (0, False)
    assert sched.stats.lookups_skipped == 2 and store.lookups == asked + 1


def test_a_background_lookup_past_its_deadline_is_a_counted_recompute_not_a_failure() -> None:
    store = CountingStore()
    _stored(store)
    settings = make_settings(scheduler={"load_deadline": True, "lookup": "async"}, transfer={"async_load": "off"})
    consumer = Engine(store, LAYOUT, settings, seed=2)
    sched = consumer.scheduler
    assert sched.enable_lookups()
    sched.deadline.model.prefill.add(1000.0)
    assert sched.lookups is not None
    sched.lookups.answer(PROMPT.request_id, 0, sched._plan(PROMPT).keys, 0.0)  # queued, never flushed: it stalls
    sched.lookups._entries[PROMPT.request_id].queued -= 1.0  # asked a second ago (the lookups' own clock)
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)
    assert sched.stats.deadline_recomputes == 1 and sched.stats.load_failures == 0
    assert sched.lookups.counters.overran == 1


@pytest.mark.parametrize("margin", ["0", "11", "x"])
def test_a_bad_margin_names_the_variable(margin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_SCHEDULER__LOAD_DEADLINE_MARGIN", margin)
    with pytest.raises(ConfigError, match="KVDI_SCHEDULER__LOAD_DEADLINE_MARGIN"):
        load_settings()


def test_the_rule_is_off_unless_asked_for() -> None:
    settings = load_settings()
    assert settings.scheduler.load_deadline is False and settings.scheduler.load_deadline_margin == 1.0
    rule = Engine(DictStore(), LAYOUT, make_settings()).scheduler.deadline
    assert not rule.enabled
    on = Engine(DictStore(), LAYOUT, make_settings(scheduler={"load_deadline_margin": 1.5, "load_deadline": True}))
    assert on.scheduler.deadline.enabled and "margin=1.5" in on.scheduler.deadline.describe()


def test_the_scheduler_halfs_counters_merge_with_a_plain_halfs_either_way() -> None:
    mine = DeadlineStats(lookups=2, deadline_recomputes=3)
    theirs = ConnectorStats(lookups=1, loaded_blocks=4)
    assert mine.merge(theirs).as_dict() == {
        **DeadlineStats(lookups=3, loaded_blocks=4, deadline_recomputes=3).as_dict()
    }
    assert theirs.merge(mine) == ConnectorStats(lookups=3, loaded_blocks=4)
