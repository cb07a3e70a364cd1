"""The load deadline against a real Redis 5 ms away behind kvdi's latency proxy, stalled mid-load (SIGSTOP): the
prefetch is abandoned at its deadline (counted), the request computes at once, and the bytes that arrive once the
server runs again never reach a KV block. The scheduler's clock is injected (no timing asserts)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdi.connectors.base import ScheduledRequest, SchedulerOutput
from kvdi.connectors.store import StoreTransferMetadata
from kvdi.settings import RedisSettings
from kvdi.testing.latency_proxy import LatencyProxy
from kvdi.testing.redis_server import RedisServer
from tests.connectors.test_deadline import Clock
from tests.helpers.store import Engine, make_settings, request, small_layout

pytest.importorskip("redis")
from kvdi.connectors.redis import RedisBlockStore

pytestmark = pytest.mark.redis

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))
BLOCKS = (1, 2, 3, 4, 5)


def redis_store(url: str) -> RedisBlockStore:
    return RedisBlockStore(RedisSettings.model_validate({"url": url, "connect_timeout_s": 2.0, "op_timeout_s": 30.0}))


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[LatencyProxy]:
    store = redis_store(redis_server.url)
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)
    store.close()
    with LatencyProxy(("127.0.0.1", redis_server.port), delay_ms=5) as p:
        yield p


def test_a_load_stalled_by_sigstop_is_abandoned_counted_and_its_late_bytes_never_land(
    redis_server: RedisServer, proxy: LatencyProxy
) -> None:
    clock = Clock()
    settings = make_settings(scheduler={"load_deadline": True, "lookup": "sync"}, transfer={"async_load": "prefetch"})
    consumer = Engine(redis_store(proxy.url("redis")), LAYOUT, settings, seed=2)
    sched, worker = consumer.scheduler, consumer.worker
    sched.deadline.model.clock = clock
    sched.deadline.model.prefill.add(1000.0)  # 16 tokens: the deadline is 20 ms
    assert sched.enable_prefetch()
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)  # a hit (one real lookup): prefetching
    before = [consumer.block(b) for b in BLOCKS]
    redis_server.freeze()
    try:
        meta = sched.build_connector_meta(SchedulerOutput(1, ()))
        assert isinstance(meta, StoreTransferMetadata) and len(meta.prefetches) == 1
        worker.bind_connector_metadata(meta)  # the fetch starts and hangs on the frozen server
        assert worker.staging is not None and worker.staging.in_flight == 1
        fetch = worker.staging._staged["r"].future
        clock.now += 0.021
        assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)  # abandoned: not waited for
        assert sched.stats.deadline_recomputes == 1
        sched.update_state_after_alloc(PROMPT, BLOCKS, 0)
        meta = sched.build_connector_meta(SchedulerOutput(2, (ScheduledRequest(PROMPT, BLOCKS, 0, 18),)))
        assert isinstance(meta, StoreTransferMetadata) and meta.loads == () and meta.prefetch_drops == ("r",)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv()
    finally:
        redis_server.thaw()
    worker.staging.shutdown()  # the fetch returns with the late bytes
    assert fetch is not None and fetch.result(30) == 4 and worker.staging.failed == 0  # they did arrive...
    assert worker.prefetch_reports() == [] and worker.staging.take("r") is None  # ...and were dropped
    for block, old in zip(BLOCKS, before, strict=True):
        assert all(a.equal(b) for a, b in zip(consumer.block(block), old, strict=True))
    assert worker.stats.loaded_blocks == 0 and worker.stats.load_failures == 0
