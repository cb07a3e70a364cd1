"""kvdi's connector against vLLM's connector contract: 0.33's signatures (from a fixture), 0.32's live, sleep hooks.

vLLM 0.33 ships only as a CUDA build, so its ``KVConnectorBase_V1`` is read from a fixture
extracted from its sdist (``tests/integrations/vllm/data/base_v033_signatures.json``, see
:mod:`tests.integrations.vllm.data.base_signatures` for how to regenerate it); 0.32's base
class is the one installed here. Every method kvdi overrides must accept what both bases
pass, and every hook 0.33 adds must be kvdi's own decision, not the base's default.

The worker hooks run on vLLM 0.32 (which never calls ``unregister_kv_caches`` /
``restore_kv_caches`` itself) over caches vLLM's own allocator built (no engine): a sleep
ends the queued saves before the cache memory would go, and kvdi's store still serves the
blocks after wake-up; a step whose finished sends are asked for before ``wait_for_save``
(vLLM's deferred finalize under speculative decoding) never reports a request sent before its
last save was queued and done.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.vllm_support import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from kvdi.connectors.base import BlockTransfer  # noqa: E402
from kvdi.connectors.store.scheduler import StoreTransferMetadata  # noqa: E402
from kvdi.integrations.vllm import KvdiConnector  # noqa: E402
from kvdi.integrations.vllm.envelopes import KvdiConnectorMetadata  # noqa: E402
from tests.integrations.vllm.data.base_signatures import (  # noqa: E402
    FIXTURE,
    mismatches,
    signature_of,
    signatures_of_class,
)
from tests.real_vllm.layout_support import Engine, logical_block, vllm_config  # noqa: E402

NEW_IN_033 = ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")


def _kvdi_overrides() -> dict[str, dict[str, object]]:
    return signatures_of_class(KvdiConnector)


def test_kvdi_connector_takes_what_vllm_033_and_032_bases_pass() -> None:
    """Each method kvdi overrides accepts the parameters of 0.33's base (fixture) and of 0.32's (live); every
    abstract method of either is kvdi's; the hooks 0.33 adds are kvdi's own (0.32's base lacks them)."""
    v033 = json.loads(FIXTURE.read_text())
    assert v033["vllm"] == "0.33.0"
    bases = {
        "0.33": {**v033["classes"]["SupportsHMA"], **v033["classes"]["KVConnectorBase_V1"]},
        "0.32": {**signatures_of_class(SupportsHMA), **signatures_of_class(KVConnectorBase_V1)},
    }
    mine = _kvdi_overrides()
    for version, base in bases.items():
        problems = {name: mismatches(sig, mine[name]) for name, sig in base.items() if name in mine}
        assert not {n: p for n, p in problems.items() if p}, f"vLLM {version}: {problems}"
        abstract = {name for name, sig in base.items() if sig["abstract"]}
        assert abstract <= set(mine), f"vLLM {version}: abstract methods kvdi lacks: {abstract - set(mine)}"
    for name in NEW_IN_033:
        assert name in bases["0.33"] and name not in bases["0.32"], name
        assert name in mine, f"kvdi keeps vLLM's default for {name}"
    assert KvdiConnector.supports_sleep_mode(None) is True
    # The comparison can fail: a signature kvdi's would not stand in for.
    assert mismatches(bases["0.33"]["save_kv_layer"], signature_of(KVConnectorBase_V1, "wait_for_save"))


def _async_worker(engine: Engine, config: VllmConfig, store: Path) -> KvdiConnector:
    """A second worker-role connector over ``engine``'s caches whose saves are queued (``transfer.async_save``)."""
    transfer = config.kv_transfer_config
    assert transfer is not None
    transfer.engine_id = f"{transfer.engine_id}-async"
    transfer.kv_connector_extra_config.update(
        {"kvdi.shared_storage.path": str(store), "kvdi.transfer.async_save": True}
    )
    try:
        connector = KvdiConnector(config, KVConnectorRole.WORKER, engine.kv_config)
    finally:
        transfer.kv_connector_extra_config["kvdi.transfer.async_save"] = False  # the config is shared (cached)
    connector.register_kv_caches(engine.caches)
    return connector


def _save_meta(ids: list[int], keys: list[bytes]) -> KvdiConnectorMetadata:
    save = (BlockTransfer("r", tuple(ids), tuple(keys[: len(ids)])),)
    return KvdiConnectorMetadata(StoreTransferMetadata((), save, (), True))


def _step_until_sent(connector: KvdiConnector) -> int:
    """Empty steps until ``r`` (finished earlier: vLLM names it once) is reported sent; the saved blocks then."""
    deadline = time.monotonic() + 20  # a bound against a hang, not a timing assertion
    while time.monotonic() < deadline:
        connector.bind_connector_metadata(KvdiConnectorMetadata(None, idle=True))
        sent = connector.get_transfer_results(set()).finished_sending
        connector.clear_connector_metadata()
        if "r" in sent:
            return connector.worker_half.stats.saved_blocks
        time.sleep(0.01)
    raise AssertionError("request r was never reported sent")


@pytest.fixture(params=["BLHNC", "LHBNC"])  # blocks contiguous (saved in place), layer-outermost (through scratch)
def engine(request: pytest.FixtureRequest, tmp_path: Path, tiny_model: Path) -> Iterator[tuple[Engine, VllmConfig]]:
    config = vllm_config(tiny_model, "float32", 1)
    made = Engine(config, tmp_path / "kv", "contract", request.param, seed=7)
    yield made, config
    made.close()


def test_sleep_ends_queued_saves_and_the_store_serves_them_after_wake_up(
    engine: tuple[Engine, VllmConfig], tmp_path: Path
) -> None:
    """``unregister_kv_caches`` returns only once the queued saves are written (none reads the cache after it);
    after ``restore_kv_caches`` the blocks load back, byte for byte; both hooks are idempotent."""
    source, config = engine
    worker = _async_worker(source, config, tmp_path / "kv")
    try:
        worker.bind_connector_metadata(_save_meta([1, 2, 3], source.keys[0]))
        worker.start_load_kv(None)
        worker.wait_for_save()
        sent = worker.get_transfer_results({"r"}).finished_sending  # r finished this step
        worker.clear_connector_metadata()
        worker.unregister_kv_caches()
        worker.unregister_kv_caches()
        assert worker.worker_half.stats.saved_blocks == 3  # written (and counted) before the hook returned
        assert worker.worker_side.asleep
        worker.restore_kv_caches()
        worker.restore_kv_caches()
        assert not worker.worker_side.asleep
        if "r" not in sent:
            _step_until_sent(worker)
    finally:
        worker.shutdown()
    before = {name: [logical_block(view, b) for b in (1, 2, 3)] for name, view in source.caches.items()}
    errors, _failed = source.load([[5, 6, 7]])
    assert not errors
    for name, view in source.caches.items():
        for block, blocks in zip((5, 6, 7), before[name], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(logical_block(view, block), blocks, strict=True))


def test_a_request_is_reported_sent_only_after_its_last_save_even_when_asked_before_wait_for_save(
    engine: tuple[Engine, VllmConfig], tmp_path: Path
) -> None:
    """vLLM's deferred finalize (speculative decoding) asks ``get_transfer_results`` before ``wait_for_save``:
    kvdi queues the step's saves first, so the finishing request is reported sent only once its save is written
    (never before it was queued, never not at all), and the later ``wait_for_save`` queues nothing twice."""
    source, config = engine
    worker = _async_worker(source, config, tmp_path / "kv")
    try:
        worker.bind_connector_metadata(_save_meta([1, 2], source.keys[0]))
        worker.start_load_kv(None)
        results = worker.get_transfer_results({"r"})  # the request finished; its saves not yet handed over
        saved_when_sent = worker.worker_half.stats.saved_blocks if "r" in results.finished_sending else None
        worker.wait_for_save()  # vLLM's finalize_step
        worker.clear_connector_metadata()
        if saved_when_sent is None:
            saved_when_sent = _step_until_sent(worker)
        worker.unregister_kv_caches()  # every queued job ended: the final count
        assert (saved_when_sent, worker.worker_half.stats.saved_blocks) == (2, 2)
    finally:
        worker.shutdown()


def test_vllm_offloading_dashboards_see_kvdi_tiers(tmp_path: Path, tiny_model: Path) -> None:
    """The series of vLLM's own offloading connector carry kvdi's counters (one worker's real steps, observed as
    ``vllm serve`` does, on a private registry); a name another connector registered first stays its own."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvdi.integrations.vllm.fleet.prom import KvdiPromMetrics

    config = vllm_config(tiny_model, "float32", 1)
    source = Engine(config, tmp_path / "kv", "dash", "BLHNC", seed=3)
    try:
        source.step(saves=[[1, 2, 3]])
        source.load([[5, 6, 7]])
        stats = source.connector.get_kv_connector_stats()
    finally:
        source.close()
    assert stats is not None
    registry = CollectorRegistry()
    taken = Counter("vllm:kv_offload_load_bytes", "vLLM's OffloadingConnector's", ["model_name"], registry=registry)
    kinds: dict[type, Any] = {k: partial(k, registry=registry) for k in (Counter, Gauge, Histogram)}
    metrics = KvdiPromMetrics(config, kinds, ["model_name", "engine"], {0: ["m", "0"]})
    metrics.observe(stats.data)
    engine = {"model_name": "m", "engine": "0"}
    kvdi = {**engine, "connector": "shared_storage", "role": "worker"}

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {**engine, **labels})

    saved, loaded = value("vllm:kvdi_saved_bytes_total", **kvdi), value("vllm:kvdi_loaded_bytes_total", **kvdi)
    assert saved and loaded and saved == loaded  # three blocks each way
    assert value("vllm:kv_offload_config_info", tier="0:disk", connector="shared_storage", store="FileBlockStore") == 1
    assert value("vllm:kv_offload_store_bytes_total") == saved
    assert value("vllm:kv_offload_tiering_write_bytes_total", tier="0:disk") == saved
    assert value("vllm:kv_offload_tiering_read_bytes_total", tier="0:disk") == loaded
    assert value("vllm:kv_offload_load_time_total") == value("vllm:kvdi_load_seconds_sum", **kvdi)
    assert value("vllm:kv_offload_load_bytes_total") is None and taken.labels("m")._value.get() == 0
