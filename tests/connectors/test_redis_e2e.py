"""The ``redis`` connector end to end: containers, the generic halves, and the reference engine on a real server."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

redis = pytest.importorskip("redis")
torch = pytest.importorskip("torch")

from kvdi.connectors.base import (  # noqa: E402
    BlockTransfer,
    BlockTransferMetadata,
    KVConnectorMetadata,
    KVRequest,
    SchedulerOutput,
    run_transfer_step,
)
from kvdi.connectors.redis import BreakerState, RedisBlockStore  # noqa: E402
from kvdi.connectors.store.keys import block_keys  # noqa: E402
from kvdi.containers import EngineContainer, KVTransferContainer, build_kv_container  # noqa: E402
from kvdi.layout import KVCacheSpec  # noqa: E402
from kvdi.testing import override_connector  # noqa: E402
from kvdi.testing.recording import RecordingSchedulerConnector  # noqa: E402
from kvdi.testing.redis_server import RedisServer  # noqa: E402

pytestmark = pytest.mark.redis

NUM_BLOCKS = 32
PROMPT = [(i * 37) % 1000 + 1 for i in range(16 * 6 + 3)]  # six full blocks and a tail
PROMPTS = [PROMPT, [(i * 11) % 1000 + 1 for i in range(16 * 3 + 1)]]


def overrides(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "allocator": {"device": "cpu", "num_blocks": NUM_BLOCKS},
        "redis": {"url": url, "op_timeout_s": 0.5, "connect_timeout_s": 0.5, "breaker_reset_s": 0.2},
        **extra,
    }


@pytest.fixture
def kv_containers(redis_server: RedisServer) -> Iterator[Callable[..., KVTransferContainer]]:
    """``make(**settings)``: a redis KVTransferContainer on the test's server; shut down after the test."""
    made: list[KVTransferContainer] = []

    def make(**extra: Any) -> KVTransferContainer:
        container = build_kv_container(kv_connector="redis", **overrides(redis_server.url, **extra))
        made.append(container)
        return container

    yield make
    for container in made:
        container.shutdown_resources()


@pytest.fixture
def engines(
    redis_server: RedisServer, engine_containers: Callable[..., EngineContainer]
) -> Callable[..., EngineContainer]:
    """``make(kv_connector=..., kv_role=...)``: an EngineContainer on the test's server; shut down after the test."""

    def make(**extra: Any) -> EngineContainer:
        return engine_containers(**overrides(redis_server.url, **extra))

    return make


def random_caches(layout: KVCacheSpec, seed: int | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    make = (lambda: torch.randn(NUM_BLOCKS, *layout.block_shape, generator=gen)) if seed is not None else None
    return {name: make() if make else torch.zeros(NUM_BLOCKS, *layout.block_shape) for name in layout.layer_names}


def saved_prompt(make: Callable[..., KVTransferContainer]) -> tuple[dict[str, torch.Tensor], list[bytes]]:
    """Save the full blocks of PROMPT (cache blocks 0..5) through a producer's worker half."""
    container = make(kv_role="kv_producer")
    layout = container.layout()
    worker = container.worker_connector()
    source = random_caches(layout, seed=1)
    worker.register_kv_caches(source)
    keys = block_keys(PROMPT, layout)
    run_transfer_step(worker, BlockTransferMetadata(saves=(BlockTransfer("p", tuple(range(len(keys))), tuple(keys)),)))
    assert worker.stats.saved_blocks == len(keys)
    return source, keys


def test_container_builds_a_redis_store_backend(kv_containers: Callable[..., KVTransferContainer]) -> None:
    assert isinstance(kv_containers().backend(), RedisBlockStore)


def test_blocks_saved_by_one_container_load_bytewise_in_another(
    kv_containers: Callable[..., KVTransferContainer],
) -> None:
    source, keys = saved_prompt(kv_containers)
    consumer = kv_containers(kv_role="kv_consumer")
    worker = consumer.worker_connector()
    dest = random_caches(consumer.layout(), seed=None)
    worker.register_kv_caches(dest)
    targets = tuple(range(10, 10 + len(keys)))
    failed = run_transfer_step(worker, BlockTransferMetadata(loads=(BlockTransfer("c", targets, tuple(keys)),)))
    assert failed == set()
    for name in source:
        assert dest[name][10 : 10 + len(keys)].numpy().tobytes() == source[name][: len(keys)].numpy().tobytes()


def test_scheduler_half_offers_the_saved_prefix(kv_containers: Callable[..., KVTransferContainer]) -> None:
    _, keys = saved_prompt(kv_containers)
    scheduler = kv_containers(kv_role="kv_consumer").scheduler_connector()
    # KVDI_TRANSFER__ASYNC_LOAD=auto loads Redis synchronously (measured faster inside vLLM, see the README).
    assert scheduler.get_num_new_matched_tokens(KVRequest("c", tuple(PROMPT)), 0) == (16 * len(keys), False)


def test_corrupt_object_is_a_counted_miss_and_deleted(
    kv_containers: Callable[..., KVTransferContainer], redis_server: RedisServer
) -> None:
    _, keys = saved_prompt(kv_containers)
    raw = redis.Redis.from_url(redis_server.url)
    name = b"kvdi:" + keys[0].hex().encode()
    value = bytearray(raw.get(name))
    value[len(value) // 2] ^= 0x01
    raw.set(name, bytes(value))
    consumer = kv_containers(kv_role="kv_consumer")
    worker = consumer.worker_connector()
    worker.register_kv_caches(random_caches(consumer.layout(), seed=None))
    failed = run_transfer_step(worker, BlockTransferMetadata(loads=(BlockTransfer("c", (0, 1), tuple(keys[:2])),)))
    assert (failed, worker.stats.corrupt_dropped, raw.exists(name)) == ({0, 1}, 1, 0)
    raw.close()


# Through the reference engine


def tokens(outputs: list[Any]) -> list[tuple[int, ...]]:
    assert all(o.ok for o in outputs), [o.error for o in outputs]
    return [o.output_token_ids for o in outputs]


def test_consumer_engine_loads_the_producer_prefix_and_matches_null(engines: Callable[..., EngineContainer]) -> None:
    expected = tokens(engines(kv_connector="null").engine().generate(PROMPTS, 6))
    engines(kv_connector="redis", kv_role="kv_producer").engine().generate(PROMPTS, 6)
    outputs = engines(kv_connector="redis", kv_role="kv_consumer").engine().generate(PROMPTS, 6)
    assert tokens(outputs) == expected
    assert [o.num_loaded_tokens for o in outputs] == [16 * 6, 16 * 3]


class KillAfterPlanningLoads(RecordingSchedulerConnector):
    """Delegates to the real scheduler half, and SIGKILLs the server once a step plans a load (sync or async)."""

    def __init__(self, inner: Any, server: RedisServer) -> None:
        super().__init__(inner.context, inner)
        self.server = server
        self.fired = False

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(output)
        planned = isinstance(meta, BlockTransferMetadata) and (meta.loads or getattr(meta, "async_loads", ()))
        if planned and not self.fired:
            self.fired = True
            self.server.kill()
        return meta


def test_server_killed_mid_run_then_restarted_keeps_outputs_identical(
    engines: Callable[..., EngineContainer], redis_server: RedisServer
) -> None:
    expected = tokens(engines(kv_connector="null").engine().generate(PROMPTS, 6))
    engines(kv_connector="redis", kv_role="kv_producer").engine().generate(PROMPTS, 6)
    container = engines(kv_connector="redis", kv_role="kv_both")
    killer = KillAfterPlanningLoads(container.kv.scheduler_connector(), redis_server)
    with override_connector(container, scheduler=killer):
        engine = container.engine()
        during = engine.generate(PROMPTS, 6)  # lookups hit, then the server dies before the loads
        after_kill = engine.generate(PROMPTS, 6)  # breaker open or server dead: misses, no stall
        redis_server.restart()
        store = container.kv.backend()
        for _ in range(200):  # bounded: the breaker probes again 0.2 s after it opened
            time.sleep(0.02)
            if engine.generate([PROMPTS[1]], 1) and store.breaker.state is BreakerState.CLOSED:
                break
        recovered = engine.generate(PROMPTS, 6)
    stats = engine.connector_stats().total
    assert tokens(during) == tokens(after_kill) == tokens(recovered) == expected
    assert killer.fired
    assert stats.load_failures > 0 and stats.save_failures > 0
    assert store.breaker.state is BreakerState.CLOSED
    assert store.count_prefix(block_keys(PROMPT, container.kv.layout())) == 6  # saved again after the restart
