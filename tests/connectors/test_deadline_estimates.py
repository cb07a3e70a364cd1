"""The load deadline's round-trip estimate under jitter (:mod:`kvdi.connectors.store.deadline_estimates`): a lone slow
answer neither refuses a hit that pays off nor skips its lookup; a rise that persists, an overrun, and a store that
moved (seen by the prober) still do. Deterministic: round trips handed in by hand or advanced on an injected clock."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvdi.connectors.store.deadline import DeadlineRule, DeadlineStats
from kvdi.connectors.store.deadline_estimates import RTT_WINDOW, SHIFT_SAMPLES, RoundTrips
from tests.connectors.test_deadline import Clock, CountingStore

HIT_TOKENS, HIT_BYTES = 100, 50_000  # recomputing: 100 ms; loading: a round trip + 50 ms at 1 MB/s
USUAL = (0.010, 0.008, 0.012, 0.009, 0.011)  # 5 ms each way, 1 ms either side


class ScriptedStore(CountingStore):
    """Each lookup moves the injected clock on by the next of ``rtts`` (a jittered store, a store that moved)."""

    def __init__(self, clock: Clock, rtts: Sequence[float]) -> None:
        super().__init__()
        self.clock, self.rtts = clock, list(rtts)

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        self.clock.now += self.rtts.pop(0)
        return super().count_prefix(keys)


def _rule(store: CountingStore | None = None, clock: Clock | None = None) -> DeadlineRule:
    rule = DeadlineRule(store or CountingStore(), "t", DeadlineStats(), enabled=True, clock=clock or Clock())
    rule.model.prefill.add(1000.0)  # 1 ms a token
    rule.model.throughput.add(1e6)  # 1 MB/s
    rule._probe_at = rule.clock()  # no background probe due
    for seconds in USUAL:
        rule.answered(seconds)
    return rule


def _pays_off(rule: DeadlineRule) -> bool:
    """The lookup is made and its hit offered (a 60 ms load against 100 ms of recompute at a 10 ms round trip), for a
    request alone in its step."""
    rule.joining = 0
    return not rule.skip_lookup(HIT_TOKENS, HIT_BYTES) and rule.offer(HIT_TOKENS, HIT_BYTES)


def test_a_jittered_store_s_lone_slow_round_trips_neither_skip_a_lookup_nor_refuse_a_hit_that_pays_off() -> None:
    rule = _rule()
    for seconds in (0.080, 0.010, 0.002, 0.080, 0.015, 0.080, 0.080, 0.006, 0.012, 0.080):  # 40 ms one way, often
        rule.answered(seconds)
        assert _pays_off(rule), f"after a {seconds * 1e3:g} ms round trip: {rule.model.describe()}"
    assert rule.stats.lookups_skipped == rule.stats.deadline_refused == 0
    assert rule.model.rtt.value == pytest.approx(0.015)  # the median of the last 9 (4 of them 80 ms)


def test_a_rise_that_persists_is_believed_after_a_few_round_trips() -> None:
    rule = _rule()
    for _ in range(SHIFT_SAMPLES - 1):
        rule.answered(0.2)
        assert _pays_off(rule)  # an outlier, or two: not yet believed
    rule.answered(0.2)
    assert rule.model.rtt.value == pytest.approx(0.2)  # the store moved: believed, the old samples forgotten
    assert rule.skip_lookup(HIT_TOKENS, HIT_BYTES) and not rule.offer(HIT_TOKENS, HIT_BYTES)
    rule.answered(0.01)
    assert rule.model.rtt.value == pytest.approx(0.2)  # one fast answer back does not undo it either


def test_an_overrun_is_believed_at_once_and_a_faster_answer_ends_it_at_once() -> None:
    rule = _rule()
    rule.overran("prefetch", HIT_TOKENS, 0.15)
    assert rule.model.rtt.value == 0.15 and rule.suspect
    assert rule.skip_lookup(HIT_TOKENS, HIT_BYTES)
    rule.joining = 0  # another request, alone in its step
    assert not rule.offer(HIT_TOKENS, HIT_BYTES)
    rule.answered(0.3)  # a round trip that ran through the stall: slower than the overrun, not an answer below it
    assert rule.model.rtt.value == 0.15 and not _pays_off(rule)
    rule.answered(0.009)  # the store answers fast again
    assert rule.model.rtt.value == pytest.approx(0.010) and _pays_off(rule)


def test_a_probe_far_off_the_estimate_asks_again_so_an_outlier_is_outvoted_and_a_move_believed() -> None:
    clock = Clock()
    store = ScriptedStore(clock, [0.080, 0.011, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01])
    rule = _rule(store, clock)
    before = store.lookups
    assert rule.probe() == pytest.approx(0.011)  # 80 ms, far off: asked again at once, 11 ms: an outlier
    assert store.lookups == before + 2 and _pays_off(rule)
    assert rule.probe() == pytest.approx(0.1)  # three 100 ms answers in a row: the store moved
    assert store.lookups == before + 5 and rule.model.rtt.value == pytest.approx(0.1)
    assert rule.skip_lookup(HIT_TOKENS, HIT_BYTES)
    assert rule.probe() == pytest.approx(0.01) and store.lookups == before + 8  # and back: believed the same way
    assert rule.model.rtt.value == pytest.approx(0.01) and _pays_off(rule)
    rule.step(0)
    assert rule.stats.deadline_probes == 8


def test_the_round_trip_estimate_is_a_clamped_median_of_a_bounded_window() -> None:
    rtt = RoundTrips(1e-3, 1.0)
    assert rtt.value is None and not rtt.unsettled
    rtt.at_least(5.0)
    assert rtt.value == 1.0  # clamped; an overrun before any answer is the estimate
    for k in range(RTT_WINDOW + 5):
        rtt.add(0.01 + k * 1e-4)
    assert len(rtt.recent) == RTT_WINDOW and rtt.samples == RTT_WINDOW + 5 and rtt.floor is None
    assert rtt.value == pytest.approx(0.01 + (5 + RTT_WINDOW // 2) * 1e-4)
    assert rtt.add(0.0, replace=True) == 1e-3 and len(rtt.recent) == 1


def test_a_deadline_allows_a_jittered_store_its_usual_slow_answers_and_a_steady_store_4x_its_round_trip() -> None:
    steady, jittered = _rule(), _rule()
    for seconds in (0.080, 0.010, 0.009, 0.085, 0.011):  # 40 ms one way, twice in 10 round trips
        jittered.answered(seconds)
    assert jittered.model.rtt.value == pytest.approx(0.011)  # the estimate the lookup decisions use: unmoved
    assert jittered.deadline_s(HIT_TOKENS) == pytest.approx(0.1)  # 4 x 80 ms: the 100 ms budget is sooner
    assert jittered.deadline_s(HIT_TOKENS, 10_000) == pytest.approx(0.1)
    assert steady.deadline_s(HIT_TOKENS) == pytest.approx(4 * 0.012)  # 4 x its slowest: a 50 ms store is caught
    assert steady.deadline_s(HIT_TOKENS, 10_000) == pytest.approx(4 * (0.012 + 0.01))
