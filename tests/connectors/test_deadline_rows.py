"""What made the ``0`` and ``50`` rows of ``bench_remote.py --rows`` exceed 1.1x with the load deadline on (issue 34),
replayed deterministically: a step's four arrivals prefetch their hits at once, not two at a time (at 50 ms the third
and fourth waited a whole round trip behind the first two, past the deadline that expects one, and were abandoned,
then recomputed); and a request the rule sends to compute is judged on the step it joins, not on its own prompt
(four arrivals judged one by one were all skipped, then recomputed in one step four prompts long)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvdi.connectors.base import SchedulerOutput
from kvdi.connectors.store.deadline import DeadlineRule, DeadlineStats
from kvdi.connectors.store.prefetch import PREFETCH_THREADS, HostStaging
from tests.connectors.test_deadline import Clock, CountingStore, _consumer, _stored
from tests.helpers.store import DictStore, request

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
    rule = _rule()  # a lookup and a whole hit: 10 + 10 + 10 = 30 ms, against 16 ms for one prompt alone
    skipped = [rule.skip_lookup(16, 10_000) for _ in range(ARRIVALS)]
    assert skipped == [True, False, False, False]  # the first computes; the others would wait for its 16 tokens too
    assert rule.stats.lookups_skipped == 1 and rule.joining == 16
    rule.step(0)
    assert rule.joining == 0 and rule.skip_lookup(16, 10_000)  # the next step's first arrival: alone again


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
    sched.deadline.model.throughput.add(4 * sched._block_bytes / 0.015)  # the whole hit: 15 ms
    answers = [sched.get_num_new_matched_tokens(request(range(18), rid=f"r{i}"), 0) for i in range(ARRIVALS)]
    assert answers == [(0, False)] + [(16, False)] * (ARRIVALS - 1)  # 25 ms: > 18 ms alone, < 36 ms joined
    assert sched.stats.lookups_skipped == 1 and sched.stats.deadline_refused == 0
    sched.build_connector_meta(SchedulerOutput(1, ()))
    sched.deadline.model.round_trip(0.005, replace=True)  # the dict store's lookups answered in microseconds
    assert sched.get_num_new_matched_tokens(request(range(18), rid="late"), 0) == (0, False)  # a new step: alone
