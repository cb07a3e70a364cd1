"""The load deadline's cold start (a background prober gives the round trip before the first request) and a stalled
store (once one wait overran, every other wait on it is abandoned at its next ask), deterministic: an injected clock
the test store advances, the store halves driven step by step (no timing asserts)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest

from kvdi.connectors.base import SchedulerOutput
from kvdi.connectors.store import StoreTransferMetadata
from kvdi.connectors.store.deadline import REFRESH_S, DeadlineRule, DeadlineStats
from tests.connectors.test_deadline import LAYOUT, PROMPT, Clock, CountingStore, _consumer, _stored
from tests.helpers.store import DictStore, Engine, make_settings, request


class SlowStore(CountingStore):
    """A store ``rtt`` seconds away on the injected clock: each lookup moves the clock on by ``rtt``."""

    def __init__(self, clock: Clock, rtt: float) -> None:
        super().__init__()
        self.clock, self.rtt = clock, rtt

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        self.clock.now += self.rtt
        return super().count_prefix(keys)


def _until(check: Callable[[], bool]) -> None:
    for _ in range(1000):
        if check():
            return
        threading.Event().wait(0.01)
    raise AssertionError("never happened")


def test_the_prober_gives_the_round_trip_before_the_first_request_so_it_is_not_asked() -> None:
    clock = Clock()
    store = SlowStore(clock, 0.1)  # 100 ms away; recomputing the prompt costs 16 ms
    _stored(store)
    settings = make_settings(scheduler={"load_deadline": True, "lookup": "async"}, transfer={"async_load": "prefetch"})
    consumer = Engine(store, LAYOUT, settings, seed=2)
    sched = consumer.scheduler
    sched.deadline.model.clock = clock
    sched.deadline.model.prefill.add(1000.0)
    asked = store.lookups
    assert sched.enable_lookups() and sched.enable_prefetch()
    try:
        _until(lambda: sched.deadline.model.rtt.value is not None)  # the prober's first probe, in the background
        assert sched.deadline.model.rtt.value == pytest.approx(0.1) and store.lookups == asked + 1
        assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)  # judged at once: never "ask again"
        assert sched.stats.lookups_skipped == 1 and store.lookups == asked + 1
    finally:
        sched.shutdown()


def test_the_rule_off_starts_no_prober() -> None:
    settings = make_settings(scheduler={"lookup": "async"}, transfer={"async_load": "off"})
    sched = Engine(CountingStore(), LAYOUT, settings).scheduler
    assert sched.enable_lookups() and sched.deadline._stop is None
    sched.shutdown()


def test_the_store_is_probed_again_only_after_refresh_s_without_an_answer() -> None:
    clock = Clock()
    store = SlowStore(clock, 0.005)
    rule = DeadlineRule(store, "t", DeadlineStats(), enabled=True, clock=clock)
    assert (
        rule.refresh() and rule.model.rtt.value == pytest.approx(0.005) and store.lookups == 1
    )  # never sampled: probed
    assert not rule.refresh()
    clock.now += REFRESH_S - 0.01
    rule.answered(0.004)  # a lookup answered: a fresh sample, no probe needed
    clock.now += REFRESH_S - 0.01
    assert not rule.refresh() and store.lookups == 1
    clock.now += 0.02
    assert (
        rule.refresh() and store.lookups == 2 and rule.model.rtt.value == pytest.approx(0.005)
    )  # idle: probed, replaced


def test_once_a_prefetch_overran_every_other_one_waiting_on_the_store_is_abandoned_at_once() -> None:
    store, clock = CountingStore(), Clock()
    _stored(store)
    other = request(range(18), rid="o")
    consumer = _consumer(store, clock)  # deadline 20 ms for a 16-token hit
    sched = consumer.scheduler
    store.gate = threading.Event()  # the store stalls mid-load
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
    clock.now += 0.015
    assert sched.get_num_new_matched_tokens(other, 0) == (None, False)  # 15 ms later
    meta = sched.build_connector_meta(SchedulerOutput(1, ()))
    assert isinstance(meta, StoreTransferMetadata) and len(meta.prefetches) == 2
    consumer.worker.bind_connector_metadata(meta)
    clock.now += 0.006  # "r" ran 21 ms, "o" 6 ms
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)  # past its deadline
    assert sched.deadline.suspect
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False)  # the store is silent: not waited for
    assert sched.stats.deadline_recomputes == 2
    meta = sched.build_connector_meta(SchedulerOutput(2, ()))
    assert isinstance(meta, StoreTransferMetadata) and sorted(meta.prefetch_drops) == ["o", "r"]
    consumer.worker.bind_connector_metadata(meta)
    store.gate.set()  # the late bytes arrive
    staging = consumer.worker.staging
    assert staging is not None
    staging.shutdown()
    assert consumer.worker.prefetch_reports() == [] and staging.held_bytes == 0  # never staged for a load
    assert sched.deadline.probe() is not None  # the store answers again: waits on it get their deadline back
    assert not sched.deadline.suspect and sched.deadline.deadline_s(16) > 0


def test_once_a_lookup_overran_the_other_background_lookups_are_abandoned_at_their_next_ask() -> None:
    store = DictStore()
    _stored(store)
    settings = make_settings(scheduler={"load_deadline": True, "lookup": "async"}, transfer={"async_load": "off"})
    sched = Engine(store, LAYOUT, settings, seed=2).scheduler
    sched.deadline.model.clock = Clock()  # the prober's clock stands still: it probes once
    assert sched.enable_lookups() and sched.lookups is not None
    try:
        _until(lambda: sched.deadline.model.rtt.samples > 0 and not sched.deadline._probing)  # its first probe
        sched.deadline.model.prefill.add(100.0)  # 18 tokens: 180 ms to recompute
        sched.deadline.model.round_trip(0.001, replace=True)
        other = request(range(18), rid="o")
        sched.lookups.answer("o", 0, sched._plan(other).keys, 10.0)  # queued, never flushed: it stalls
        sched.lookups._entries["o"].queued -= 0.001  # asked 1 ms ago: far within its own deadline (180 ms)
        sched.deadline.overran("lookup", 16, 0.05)  # another lookup on this store overran
        assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
        assert sched.lookups.counters.overran == 1 and sched.stats.deadline_recomputes == 2
    finally:
        sched.shutdown()
