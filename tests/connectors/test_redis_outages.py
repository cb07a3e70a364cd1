"""Redis outages are loud every time: a second outage logs its save warning again (issue 32)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

redis = pytest.importorskip("redis")
torch = pytest.importorskip("torch")

from kvdi.connectors import logging_once  # noqa: E402
from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata, WorkerConnector, run_transfer_step  # noqa: E402
from kvdi.connectors.redis import BreakerState, RedisBlockStore  # noqa: E402
from kvdi.connectors.store.keys import block_keys  # noqa: E402
from kvdi.containers import KVTransferContainer, build_kv_container  # noqa: E402
from kvdi.testing.redis_server import RedisServer  # noqa: E402

pytestmark = pytest.mark.redis

INTERVAL_S = 0.3


@pytest.fixture
def producer(redis_server: RedisServer) -> Iterator[KVTransferContainer]:
    """A redis producer container on the test's server, its breaker probing again 0.1 s after it opens."""
    redis_opts = {
        "url": redis_server.url,
        "op_timeout_s": 0.5,
        "connect_timeout_s": 0.5,
        "breaker_reset_s": 0.1,
        "breaker_failures": 1,
    }
    container = build_kv_container(
        kv_connector="redis",
        kv_role="kv_producer",
        allocator={"device": "cpu", "num_blocks": 32},
        redis=redis_opts,
        transfer={"async_save": False},
    )
    yield container
    container.shutdown_resources()


def _save(worker: WorkerConnector, container: KVTransferContainer, seed: int) -> None:
    """Save two full blocks of a prompt unique to ``seed`` from cache blocks 0 and 1."""
    keys = block_keys([seed * 1000 + i for i in range(2 * container.layout().block_size)], container.layout())
    run_transfer_step(worker, BlockTransferMetadata(saves=(BlockTransfer(f"r{seed}", (0, 1), tuple(keys)),)))


def _save_warnings(caplog: pytest.LogCaptureFixture) -> int:
    return sum("saving KV failed" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_second_outage_logs_the_save_warning_again(
    producer: KVTransferContainer,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis down, up, down again (later than the log interval): each outage's failed save is a warning."""
    monkeypatch.setattr(logging_once, "LOG_INTERVAL_S", INTERVAL_S, raising=False)
    caplog.set_level(logging.WARNING, logger="kvdi")
    layout = producer.layout()
    worker = producer.worker_connector()
    assert isinstance(worker, WorkerConnector)
    worker.register_kv_caches({name: torch.zeros(32, *layout.block_shape) for name in layout.layer_names})
    store = producer.backend()
    assert isinstance(store, RedisBlockStore)

    redis_server.stop()
    _save(worker, producer, 1)
    _save(worker, producer, 2)
    first = _save_warnings(caplog)
    assert first >= 1
    _save(worker, producer, 5)  # the same outage, within the interval: nothing new
    assert _save_warnings(caplog) == first

    redis_server.start()
    deadline = time.monotonic() + 10
    while store.breaker.state is not BreakerState.CLOSED and time.monotonic() < deadline:
        time.sleep(0.05)
        _save(worker, producer, 3)
    assert store.breaker.state is BreakerState.CLOSED
    time.sleep(INTERVAL_S)

    redis_server.stop()
    _save(worker, producer, 4)
    assert _save_warnings(caplog) > first
