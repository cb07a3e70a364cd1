"""A scheduler half behind one breaker (a Redis server) has a quiet step as cheap as the null half's (vLLM-free).

The adapter's stats hook answers a quiet step itself when the counters say ``unmoved_is_empty``; a half whose store
has one breaker now says so too, and names the breaker's move count (``moved_by``) for the adapter to compare with
``moves_seen`` by attribute reads. Before, such a half was asked for an entry every step: one call more than null's
(issue 31's 43 calls against 42). A breaker's move is still seen at the next step.
"""

from __future__ import annotations

from kvdi.connectors.breaker import BreakerMoves, CircuitBreaker
from kvdi.integrations.vllm.fleet.counters import FleetCounters
from tests.helpers.store import DictStore, Engine, make_settings, small_layout
from tests.integrations.vllm.test_vllm_breaker_moves import BreakerStore, Clock, UncountedHealthStore

LAYOUT = small_layout(block_size=4)
GAUGE = "g|scheduler|0-0|breaker_open|node"


def adapter_skips(counters: FleetCounters) -> bool:
    """The adapter's quiet-step test (``KvdiConnector.get_kv_connector_stats``) with no counter moved and no miss."""
    moved = counters.moved_by is not None and counters.moved_by.count != counters.moves_seen
    return not moved and counters.unmoved_is_empty


def scheduler_counters(store: DictStore) -> FleetCounters:
    engine = Engine(store, LAYOUT, make_settings(transfer={"async_load": "off"}), seed=1)
    return FleetCounters("scheduler", "0-0", engine.scheduler)


def test_one_breaker_is_read_by_the_adapter_and_its_moves_still_reach_the_gauge() -> None:
    clock = Clock()
    store = BreakerStore(CircuitBreaker(1, 10.0, clock))
    counters = scheduler_counters(store)
    assert counters.unmoved_is_empty and counters.moved_by is store.breaker.moves
    assert not adapter_skips(counters)  # never read: the first step sends the gauge
    assert counters.entry(None) == {GAUGE: 0.0}
    assert adapter_skips(counters)  # quiet: no entry asked for
    store.breaker.record_failure()  # a lookup failed: the breaker opens
    assert not adapter_skips(counters)
    assert counters.entry(None) == {GAUGE: 1.0}
    assert adapter_skips(counters)
    clock.now = 10.0
    assert store.breaker.allow()  # the probe: half-open, the node serves it
    assert not adapter_skips(counters) and counters.entry(None) == {GAUGE: 0.0}


def test_health_no_single_count_covers_is_still_asked_every_step() -> None:
    assert not scheduler_counters(UncountedHealthStore()).unmoved_is_empty


def test_a_half_without_health_is_quiet_with_no_breaker_to_read() -> None:
    counters = scheduler_counters(DictStore())
    assert counters.unmoved_is_empty and counters.moved_by is None and adapter_skips(counters)


def test_shared_move_counts_are_one_count() -> None:
    shared = BreakerMoves()
    store = BreakerStore(CircuitBreaker(1, 1.0, Clock(), shared))
    assert scheduler_counters(store).moved_by is shared
