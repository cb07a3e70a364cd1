"""A breaker's Prometheus gauge is read when a breaker moved, whoever moved it, and not on a quiet step (vLLM-free).

The gauge ``breaker_open`` is sent by both roles' fleet counters (:mod:`kvdi.integrations.vllm.fleet.counters`).
Each breaker counts its own changes of state (:class:`~kvdi.connectors.breaker.BreakerMoves`), so a quiet step
reads no breaker, yet a breaker opened by a call that is not this rank's transfer (the scheduler's lookups on the
store an in-process engine shares, the deadline's prober) or made the probe once its reset time passed is still
seen at the next step. Calls are counted with ``sys.setprofile`` (deterministic, no timing).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvdi.connectors.breaker import BreakerMoves, CircuitBreaker
from kvdi.connectors.redis import RedisBlockStore, RedisClusterBlockStore
from kvdi.integrations.vllm.fleet.counters import FleetCounters, breaker_moves
from kvdi.integrations.vllm.fleet.store_metrics import StoreCounters
from kvdi.settings import RedisSettings
from kvdi.testing.redis_server import RedisServer
from tests.helpers.calls import calls
from tests.helpers.store import DictStore, Engine, make_settings, small_layout

LAYOUT = small_layout(block_size=4)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class BreakerStore(DictStore):
    """A DictStore behind one real breaker, on a clock the test moves (a HealthStore like a Redis server's)."""

    def __init__(self, breaker: CircuitBreaker) -> None:
        super().__init__()
        self.breaker = breaker

    def health(self) -> dict[str, bool]:
        from kvdi.connectors.breaker import BreakerState

        return {"node": self.breaker.state is not BreakerState.OPEN}


class UncountedHealthStore(DictStore):
    """A HealthStore of a third party: its health says nothing about when it changes."""

    def __init__(self) -> None:
        super().__init__()
        self.serving = True
        self.asked = 0

    def health(self) -> dict[str, bool]:
        self.asked += 1
        return {"node": self.serving}


def test_each_change_of_a_breakers_state_is_counted_and_nothing_else() -> None:
    clock = Clock()
    breaker = CircuitBreaker(2, 10.0, clock)
    moves = breaker.moves
    breaker.record_failure()
    assert moves.count == 0  # one failure of two: still closed
    breaker.record_failure()
    assert moves.count == 1  # opened
    assert not breaker.allow() and moves.count == 1  # refused: still open
    clock.now = 10.0
    assert moves.count == 1  # the reset time passed: nothing moves until a call comes
    assert breaker.allow() and moves.count == 2  # that call is the probe: half-open
    breaker.release_probe()
    assert moves.count == 3  # back to open
    assert breaker.allow() and breaker.record_success() and moves.count == 5  # probed, then closed
    assert not breaker.record_success() and moves.count == 5  # already closed


def test_breakers_of_one_store_share_one_count() -> None:
    shared = BreakerMoves()
    first, second = CircuitBreaker(1, 1.0, Clock(), shared), CircuitBreaker(1, 1.0, Clock(), shared)
    first.record_failure()
    second.record_failure()
    assert shared.count == 2


def test_a_breaker_moved_by_a_lookup_is_read_at_the_next_step_and_a_quiet_step_reads_none() -> None:
    """The scheduler's lookups, not the worker's transfers, open the breaker: the worker's gauge epoch stands still,
    and the gauge must still move (a skip on the worker's epoch alone left it at 0 with Redis down)."""
    clock = Clock()
    store = BreakerStore(CircuitBreaker(1, 10.0, clock))
    engine = Engine(store, LAYOUT, make_settings(transfer={"async_load": "off"}), seed=1)
    worker = StoreCounters("worker", "0-0", engine.worker, [store])
    scheduler = FleetCounters("scheduler", "0-0", engine.scheduler)
    gauge = "g|{}|0-0|breaker_open|node"
    assert (worker.entry(None) or {})[gauge.format("worker")] == 0.0
    assert scheduler.entry(None) == {gauge.format("scheduler"): 0.0}
    assert calls(worker.entry, None) == (1, None) and calls(scheduler.entry, None) == (1, None)
    epoch = engine.worker.gauge_epoch
    store.breaker.record_failure()  # a lookup failed: the breaker opens
    assert engine.worker.gauge_epoch == epoch
    assert (worker.entry(None) or {})[gauge.format("worker")] == 1.0
    assert scheduler.entry(None) == {gauge.format("scheduler"): 1.0}
    assert calls(worker.entry, None) == (1, None) and calls(scheduler.entry, None) == (1, None)
    clock.now = 10.0  # the reset time passed: still open until a call probes
    assert worker.entry(None) is None and scheduler.entry(None) is None
    assert store.breaker.allow()  # the next call is the probe: the node serves that call
    assert (worker.entry(None) or {})[gauge.format("worker")] == 0.0
    assert scheduler.entry(None) == {gauge.format("scheduler"): 0.0}
    store.breaker.release_probe()  # it did not reach the server: open again
    assert (worker.entry(None) or {})[gauge.format("worker")] == 1.0
    assert scheduler.entry(None) == {gauge.format("scheduler"): 1.0}
    assert store.breaker.allow() and store.breaker.record_success()
    assert (worker.entry(None) or {})[gauge.format("worker")] == 0.0
    assert scheduler.entry(None) == {gauge.format("scheduler"): 0.0}
    assert worker.entry(None) is None and scheduler.entry(None) is None


def test_a_health_store_that_counts_no_moves_is_read_every_step() -> None:
    store = UncountedHealthStore()
    assert breaker_moves(store) is None
    engine = Engine(store, LAYOUT, make_settings(), seed=1)
    counters = FleetCounters("scheduler", "0-0", engine.scheduler)
    assert counters.entry(None) == {"g|scheduler|0-0|breaker_open|node": 0.0}
    assert counters.entry(None) is None and store.asked == 2
    store.serving = False
    assert counters.entry(None) == {"g|scheduler|0-0|breaker_open|node": 1.0}


@pytest.mark.redis
def test_a_redis_servers_breaker_opened_by_a_lookup_reaches_the_worker_gauge(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """Real Redis stopped: a lookup opens the breaker and the worker's next entry says so; Redis back, the first call
    after the reset time probes and closes it, and the entry after says 0."""
    server = redis_server_factory()
    options = {"url": server.url, "op_timeout_s": 0.5, "connect_timeout_s": 0.5}
    store = RedisBlockStore(RedisSettings(**options, breaker_failures=1, breaker_reset_s=0.2))  # type: ignore[arg-type]
    try:
        assert breaker_moves(store) == [store.breaker.moves]
        engine = Engine(store, LAYOUT, make_settings(transfer={"async_load": "off"}), seed=1)
        counters = StoreCounters("worker", "0-0", engine.worker, [store])
        gauge = f"g|worker|0-0|breaker_open|{store.url}"
        assert (counters.entry(None) or {})[gauge] == 0.0
        assert calls(counters.entry, None) == (1, None)
        server.stop()
        with pytest.raises(ConnectionError):
            store.count_prefix([b"k" * 16])
        assert counters.entry(None) == {gauge: 1.0}
        assert calls(counters.entry, None) == (1, None)
        server.start()
        time.sleep(0.25)  # past breaker_reset_s: the next call is the probe
        assert store.count_prefix([b"k" * 16]) == 0
        assert counters.entry(None) == {gauge: 0.0}
        assert calls(counters.entry, None) == (1, None)
    finally:
        store.close()


def test_a_cluster_stores_breakers_and_nodes_share_its_count() -> None:
    store = RedisClusterBlockStore(RedisSettings(url="redis://127.0.0.1:1", cluster=True))  # type: ignore[arg-type]
    assert breaker_moves(store) == [store.breaker_moves]
    store.close()
