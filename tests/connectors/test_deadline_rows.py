"""What made the ``0`` and ``50`` rows of ``bench_remote.py --rows`` exceed 1.1x with the load deadline on (issue 34),
replayed deterministically: a step's four arrivals prefetch their hits at once, not two at a time (at 50 ms the third
and fourth waited a whole round trip behind the first two, past the deadline that expects one, and were abandoned,
then recomputed); and a request the rule sends to compute is judged on the step it joins, not on its own prompt
(four arrivals judged one by one were all skipped, then recomputed in one step four prompts long)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from kvdi.connectors.base import SchedulerOutput
from kvdi.connectors.store.deadline import DeadlineRule, DeadlineStats
from kvdi.connectors.store.prefetch import PREFETCH_THREADS, HostStaging
from tests.connectors.test_deadline import LAYOUT, PROMPT, Clock, CountingStore, _consumer, _stored
from tests.helpers.store import DictStore, Engine, make_settings, request

ARRIVALS = 4  # the row's requests, arriving together


class RendezvousStore(DictStore):
    """A store across a network: each ``get_many`` answers only once ``ARRIVALS`` of them are in flight together (a
    round trip they all wait out at once); fewer in flight at once break the rendezvous (the call raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.rendezvous = threading.Barrier(ARRIVALS, timeout=2.0)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        self.rendezvous.wait()
        return super().get_many(keys)


def test_a_step_s_arrivals_prefetch_at_once() -> None:
    store = RendezvousStore()
    for r in range(ARRIVALS):
        store.put_many([(f"k{r}".encode(), [b"x" * 16])])
    staging = HostStaging(store, 1 << 20, 64, "t")
    assert PREFETCH_THREADS >= ARRIVALS
    try:
        for r in range(ARRIVALS):
            staging.start(f"r{r}", [f"k{r}".encode()])
        reports: list[tuple[str, int]] = []
        while len(reports) < ARRIVALS and staging.wait(5.0):
            got, failed = staging.reports()
            assert failed == 0, "a prefetch waited for another to finish: the rendezvous broke"
            reports += got
        assert sorted(reports) == [(f"r{r}", 1) for r in range(ARRIVALS)]
    finally:
        staging.shutdown()


def _rule() -> DeadlineRule:
    rule = DeadlineRule(DictStore(), "t", DeadlineStats(), enabled=True, clock=Clock())
    rule.model.prefill.add(1000.0)  # 16 tokens: 16 ms to recompute
    rule.model.round_trip(0.010)
    rule.model.throughput.add(1e6)  # 10 kB: 10 ms
    rule._probe_at = rule.clock()  # no background probe due
    return rule


def test_a_recompute_is_judged_on_the_step_it_joins_not_on_its_own_prompt() -> None:
    rule = _rule()  # a lookup and a whole hit: 10 + 10 + 10 = 30 ms, against 25 ms for one prompt alone
    skipped = [rule.skip_lookup(25, 10_000) for _ in range(ARRIVALS)]
    # The first computes; a lookup of the others is answered after its 25 ms step, and loads by 25 + 20 = 45 ms,
    # sooner than the 50 ms they would compute in with it.
    assert skipped == [True, False, False, False]
    assert rule.stats.lookups_skipped == 1 and rule.joining == 25
    rule.step(0)
    assert rule.joining == 0 and rule.skip_lookup(25, 10_000)  # the next step's first arrival: alone again


def test_a_lookup_waits_out_the_step_the_others_compute_in() -> None:
    """The 50 ms row's p90 (issue 34): the fourth arrival was looked up (a round trip and a whole hit, 212 ms, less
    than the four prompts' step, 256 ms), but vLLM asks again only after the three others' step (192 ms): its load
    ended at 303 ms, later than computing it with them. It computes with them now."""
    rule = _rule()
    rule.model.prefill.add(8000.0, replace=True)  # 512 tokens: 64 ms
    rule.model.round_trip(0.101, replace=True)
    rule.model.throughput.add(185e6, replace=True)  # 2 MB: 11 ms
    skipped = [rule.skip_lookup(512, 2_000_000) for _ in range(ARRIVALS)]
    assert skipped == [True] * ARRIVALS  # the fourth: max(101, 192) + 101 + 11 = 303 ms > 256 ms
    assert rule.joining == ARRIVALS * 512
    rule = _rule()
    assert [rule.skip_lookup(16, 10_000) for _ in range(ARRIVALS)] == [True] * ARRIVALS  # 16 + 20 ms > 32 ms


def test_before_the_throughput_is_measured_a_hit_s_load_is_a_round_trip() -> None:
    """A store 50 ms away before its first prefetch (an engine's first requests): a lookup (100 ms) was judged on its
    round trip alone, less than recomputing (121 ms), and its hit's load (another 100 ms) was found only by its
    deadline (three prefetches abandoned at 273 ms, then recomputed)."""
    rule = DeadlineRule(DictStore(), "t", DeadlineStats(), enabled=True, clock=Clock())
    rule._probe_at = rule.clock()
    rule.model.prefill.add(1000.0)
    rule.model.round_trip(0.010)
    assert rule.model.throughput.value is None
    assert rule.skip_lookup(16, 10_000)  # 10 + 10 ms > 16 ms
    assert not rule.skip_lookup(25, 10_000)  # 20 ms < 25 ms: a lookup
    assert not rule.skip_lookup(25)  # nothing to load (its tokens are vLLM's): the round trip alone


def test_a_refused_hit_joins_the_step_too() -> None:
    rule = _rule()
    assert [rule.offer(16, 10_000) for _ in range(2)] == [False, True]  # 20 ms: > 16 ms alone, < 32 ms joined
    assert rule.stats.deadline_refused == 1


def test_a_step_s_arrivals_load_once_the_first_computes() -> None:
    store, clock = CountingStore(), Clock()
    _stored(store)
    consumer = _consumer(store, clock, async_load="off")  # 18 tokens: 18 ms to recompute
    sched = consumer.scheduler
    sched.deadline._probe_at = clock.now
    sched.deadline.model.round_trip(0.005)
    sched.deadline.model.throughput.add(4 * sched._block_bytes / 0.010)  # the whole hit: 10 ms
    answers = [sched.get_num_new_matched_tokens(request(range(18), rid=f"r{i}"), 0) for i in range(ARRIVALS)]
    # 5 + 15 = 20 ms: > 18 ms alone; after the first's step, 18 + 15 = 33 ms < 36 ms joined
    assert answers == [(0, False)] + [(16, False)] * (ARRIVALS - 1)
    assert sched.stats.lookups_skipped == 1 and sched.stats.deadline_refused == 0
    sched.build_connector_meta(SchedulerOutput(1, ()))
    sched.deadline.model.round_trip(0.005, replace=True)  # the dict store's lookups answered in microseconds
    assert sched.get_num_new_matched_tokens(request(range(18), rid="late"), 0) == (0, False)  # a new step: alone


def test_a_lookup_once_made_is_not_judged_again_when_vllm_asks_again() -> None:
    """A request looked up while others computed (its answer due after their step) was judged again when vLLM asked
    again: the others' step gone, alone its lookup looked dearer than recomputing, so it was skipped, having waited a
    step for nothing, and computed a step after the others (the 50 ms row: 1.16x at p90). Its lookup stands."""
    store = CountingStore()
    _stored(store)
    settings = make_settings(scheduler={"load_deadline": True, "lookup": "async"}, transfer={"async_load": "off"})
    sched = Engine(store, LAYOUT, settings, seed=2).scheduler
    assert sched.enable_lookups() and sched.lookups is not None
    sched.deadline.stop()  # no background prober: the estimates are the test's
    rule = sched.deadline
    rule._probe_at = float("inf")
    rule.model.prefill.add(1000.0)  # 18 tokens: 18 ms
    for _ in range(5):
        rule.model.round_trip(0.012)  # the dict store's own answer (microseconds) does not move the median
    rule.model.throughput.add(1e12)  # the bytes cost nothing: a load is its round trip
    rule.joining = 20  # others compute 20 tokens in this step: 20 + 12 = 32 ms < 38 ms joined
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)  # looked up in the background
    sched.build_connector_meta(SchedulerOutput(1, ()))  # the step: the others computed, the lookup left
    assert rule.joining == 0 and sched.lookups.wait(5.0)
    # Judged again, alone: 12 + 12 = 24 ms > 18 ms, skipped. Not judged again: its answer, a hit of 12 ms < 16 ms.
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (16, False)
    assert sched.stats.lookups_skipped == 0 and sched.stats.deadline_recomputes == 0


def test_a_step_s_fixed_part_is_left_out_of_the_prefill_rate_and_of_what_a_join_costs() -> None:
    """The 50 ms row on a loaded CPU (issue 34): a 512-token step took 164 ms, 100 ms of them the step's fixed part
    (a decode step's time). Linear in tokens, four prompts' step was 656 ms, and the second to fourth arrivals were
    looked up (276 ms) to load after the first's step, later than the four prompts' real step (356 ms)."""
    clock = Clock()
    rule = DeadlineRule(DictStore(), "t", DeadlineStats(), enabled=True, clock=clock)
    rule._probe_at = clock.now
    rule.step(4)
    clock.now += 0.100
    rule.step(512)  # the decode step took 100 ms: the fixed part
    clock.now += 0.164
    rule.step(4)  # 512 tokens in 164 ms: 64 ms beyond the fixed part, 8000 tokens/s
    assert rule.model.overhead.value == pytest.approx(0.1) and rule.model.prefill.value == pytest.approx(8000)
    assert rule.model.recompute_s(2048) == pytest.approx(0.356)
    rule.model.round_trip(0.101, replace=True)
    rule.model.throughput.add(185e6, replace=True)  # 2 MB: 11 ms
    skipped = [rule.skip_lookup(512, 2_000_000) for _ in range(ARRIVALS)]
    assert skipped == [True] * ARRIVALS  # the second: max(101, 164) + 112 = 276 ms > 228 ms, its 64 ms joined
