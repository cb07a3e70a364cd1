"""``vllm:kvdi_redis_breaker_open`` tracks a real Redis server's breaker through kvdi's Prometheus path (issue 32).

A worker half on real Redis (the test's own server), its fleet counters, each step's stats (one rank: nothing to sum)
(:class:`~kvdi.integrations.vllm.fleet.prom.FleetConnectorStats`) and :class:`KvdiPromMetrics`, the object
``vllm serve`` builds for ``/metrics``, on a private registry. No engine starts: it adds nothing to this path.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest

from kvdi.testing.redis_server import RedisServer
from tests.real_vllm.vllm_support import require_vllm

require_vllm()

pytestmark = pytest.mark.redis


def test_the_breaker_gauge_goes_to_1_while_redis_is_down_and_back_to_0(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    """Redis stopped: once the breaker opens the gauge reads 1; Redis back and the breaker closed: it reads 0."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvdi.connectors.base import WorkerConnector
    from kvdi.connectors.redis import BreakerState, RedisBlockStore
    from kvdi.containers import build_kv_container
    from kvdi.integrations.vllm.fleet.events import WorkerFleet
    from kvdi.integrations.vllm.fleet.prom import KvdiPromMetrics, step_stats
    from kvdi.integrations.vllm.parallel import RankSlice

    server = redis_server_factory()
    redis = {
        "url": server.url,
        "op_timeout_s": 0.5,
        "connect_timeout_s": 0.5,
        "breaker_failures": 1,
        "breaker_reset_s": 0.2,
    }
    container = build_kv_container(
        kv_connector="redis", kv_role="kv_both", allocator={"device": "cpu", "num_blocks": 8}, redis=redis
    )
    try:
        store = container.backend()
        assert isinstance(store, RedisBlockStore)
        worker = container.worker_connector()
        assert isinstance(worker, WorkerConnector)
        fleet = WorkerFleet(worker, RankSlice(), events_on=False)
        registry = CollectorRegistry()
        kinds: dict[type, Any] = {k: partial(k, registry=registry) for k in (Counter, Gauge, Histogram)}
        extra = {"kvdi.kv_connector": "redis", "kvdi.redis.url": server.url}
        vllm_config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_both", engine_id="e")
        )
        metrics = KvdiPromMetrics(vllm_config, kinds, ["model_name", "engine"], {0: ["m", "0"]})
        labels = {"model_name": "m", "engine": "0", "connector": "redis", "role": "worker", "node": store.url}

        def step() -> float | None:
            """One engine step's report (only what changed), observed as vLLM does; the gauge's value after it."""
            stats = step_stats("redis", None, None, fleet.counters.entry(None))
            if stats is not None:
                metrics.observe(stats.data)
            value = registry.get_sample_value("vllm:kvdi_redis_breaker_open", labels)
            return None if value is None else float(value)

        assert step() == 0.0
        server.stop()
        with pytest.raises(ConnectionError):
            store.count_prefix([b"k" * 16])
        assert store.health() == {store.url: False}  # the breaker is open
        assert step() == 1.0
        server.start()
        deadline = time.monotonic() + 10
        while store.breaker.state is not BreakerState.CLOSED and time.monotonic() < deadline:
            time.sleep(0.1)
            with contextlib.suppress(ConnectionError):  # refused until breaker_reset_s has passed
                store.count_prefix([b"k" * 16])
        assert store.breaker.state is BreakerState.CLOSED
        assert step() == 0.0
    finally:
        container.shutdown_resources()
