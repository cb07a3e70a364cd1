"""The load deadline never abandons a load before the store's usual slow end (issue 34): a jittered store's usual
slow prefetch is waited for, not abandoned at the budget and recomputed (which paid both), while a store slower than
that is still abandoned within the budget plus one recompute; and a jittered prefetch's slow sample does not move
the throughput the lookups are judged on. Deterministic: an injected clock and estimates handed in by hand."""

from __future__ import annotations

import threading

import pytest

from kvdi.connectors.base import SchedulerOutput
from kvdi.connectors.store import StoreTransferMetadata
from kvdi.connectors.store.deadline import DeadlineRule, DeadlineStats
from kvdi.connectors.store.deadline_estimates import RTT_WINDOW, TAIL_WINDOW, CostModel, RoundTrips
from tests.connectors.test_deadline import PROMPT, Clock, CountingStore, _consumer, _stored

TOKENS = 50  # recomputing: 50 ms at 1000 tokens/s, the budget at margin 1
NBYTES = 10_000  # 10 ms at 1 MB/s
JITTER = (0.010, 0.009, 0.011, 0.010, 0.080)  # one round trip in five 80 ms (40 ms one way)


def _rule(round_trips: tuple[float, ...] = JITTER * 4) -> DeadlineRule:
    rule = DeadlineRule(CountingStore(), "t", DeadlineStats(), enabled=True, clock=Clock())
    rule.model.prefill.add(1000.0)
    rule.model.throughput.add(1e6)
    rule._probe_at = rule.clock()  # no background probe due
    for seconds in round_trips:
        rule.answered(seconds)
    return rule


def test_a_load_is_given_the_store_s_usual_slow_end_plus_its_transfer_beyond_the_budget() -> None:
    rule = _rule()
    assert rule.model.rtt.value == pytest.approx(0.010) and rule.model.rtt.tail == pytest.approx(0.080)
    assert not rule.skip_lookup(TOKENS, NBYTES) and rule.offer(TOKENS, NBYTES)  # 20 ms expected: it pays off
    # the previous rule abandoned it at the 50 ms budget, then recomputed it: a usual 90 ms load cost 100 ms
    assert rule.deadline_s(TOKENS, NBYTES) == pytest.approx(0.080 + 0.010)
    assert rule.deadline_s(TOKENS) == pytest.approx(0.080)  # a background lookup: the slow end of round trips


def test_the_slow_end_is_taken_over_more_round_trips_than_the_median() -> None:
    rtts = JITTER * 3 + (0.010,) * RTT_WINDOW  # the outliers left the median's window, not the tail's
    rule = _rule(rtts)
    assert len(rtts) <= TAIL_WINDOW and 0.080 not in rule.model.rtt.recent
    assert rule.deadline_s(TOKENS, NBYTES) == pytest.approx(0.090)


def test_the_wait_past_the_budget_is_bounded_by_one_more_recompute() -> None:
    rule = _rule((0.010, 0.5, 0.5, 0.010, 0.5, 0.010, 0.010))  # a slow end of 500 ms
    assert rule.model.rtt.value == pytest.approx(0.010)
    assert rule.deadline_s(TOKENS, NBYTES) == pytest.approx(2 * 0.050)  # the budget and one recompute, not 510 ms
    rule.margin = 2.0
    assert rule.deadline_s(TOKENS, NBYTES) == pytest.approx(3 * 0.050)


def test_a_steady_store_that_turns_slow_is_still_caught_at_a_few_round_trips() -> None:
    rule = _rule((0.002, 0.0021, 0.0019, 0.002, 0.0022))
    assert rule.deadline_s(TOKENS) == pytest.approx(0.02)  # 4 x 2.2 ms (its slowest), at least 20 ms
    assert rule.deadline_s(TOKENS, NBYTES) == pytest.approx(4 * (0.0022 + 0.010))


def test_a_shift_moves_the_median_at_once_and_the_slow_end_keeps_the_store_s_recent_outliers() -> None:
    rtt = RoundTrips()
    for seconds in JITTER * 4 + (0.001,) * 3:  # three fast answers in a row: the median's window restarts
        rtt.add(seconds)
    assert rtt.value == pytest.approx(0.001) and rtt.recent == (0.001,) * 3
    assert rtt.tail == pytest.approx(0.080)  # a jittered store shifts now and then: its outliers are still usual


def test_a_jittered_prefetch_s_slow_sample_does_not_move_the_throughput() -> None:
    model = CostModel(Clock())
    model.round_trip(0.001)
    for _ in range(6):
        model.transfer(1_000_000, 0.005)  # 1 MB in 4 ms beyond the round trip: 250 MB/s
    for _ in range(3):
        model.transfer(1_000_000, 0.090)  # a prefetch behind a 40 ms-each-way round trip
    assert model.throughput.value == pytest.approx(250e6)  # an average weighing them 0.2 fell to 131 MB/s
    model.prefill.add(20_000.0)  # 512 tokens: 25.6 ms to recompute
    assert model.load_s(1_000_000) == pytest.approx(0.005)


def test_a_prefetch_is_waited_for_until_the_store_s_usual_slow_end_then_loads() -> None:
    store, clock = CountingStore(), Clock()
    _stored(store)
    consumer = _consumer(store, clock)  # 16 tokens: 16 ms to recompute
    sched = consumer.scheduler
    rule = sched.deadline
    rule._probe_at = clock.now
    for seconds in (0.002, 0.002, 0.025, 0.002, 0.002, 0.002, 0.025, 0.002, 0.002):  # jittered: 25 ms, often
        rule.answered(seconds)
    rule.model.throughput.add(1e9)
    store.gate = threading.Event()  # the prefetch is one of the store's usual slow answers
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
    meta = sched.build_connector_meta(SchedulerOutput(1, ()))
    assert isinstance(meta, StoreTransferMetadata) and len(meta.prefetches) == 1
    consumer.worker.bind_connector_metadata(meta)
    clock.now += 0.024  # past the 16 ms budget and the 20 ms floor: the previous rule abandoned it here
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
    store.gate.set()
    assert consumer.worker.staging is not None and consumer.worker.staging.wait(10)
    clock.now += 0.001
    sched.prefetched(consumer.worker.prefetch_reports())
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (16, False)
    assert sched.stats.deadline_recomputes == 0


def test_a_prefetch_past_the_slow_end_is_still_abandoned() -> None:
    store, clock = CountingStore(), Clock()
    _stored(store)
    consumer = _consumer(store, clock)
    sched = consumer.scheduler
    sched.deadline._probe_at = clock.now
    for seconds in (0.002, 0.002, 0.025, 0.002, 0.002, 0.002, 0.025, 0.002, 0.002):
        sched.deadline.answered(seconds)
    sched.deadline.model.throughput.add(1e9)
    store.gate = threading.Event()
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
    consumer.worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput(1, ())))
    clock.now += 0.026  # past 25 ms and the bytes
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)
    assert sched.stats.deadline_recomputes == 1
    store.gate.set()
    assert consumer.worker.staging is not None
    consumer.worker.staging.shutdown()
