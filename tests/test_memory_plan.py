"""Memory kvdi uses outside the KV cache: planned, bounded by a setting, shown by ``kvdi info``.

- host staging is host memory: never counted against the device's free memory;
- device staging (a p2p NCCL fetch's landing zone) is bounded by ``allocator.max_staging_bytes``
  and counted against the device;
- a p2p fetch is split so its staging fits ``allocator.max_staging_bytes``;
- cpu_offload's pool is never pinned (no device copy reads it).
"""

from __future__ import annotations

import pytest
import torch

from kvdi.allocator import plan_allocation
from kvdi.connectors.p2p.scheduler import P2pTransferMetadata
from kvdi.errors import AllocationError
from kvdi.layout import KVCacheSpec
from kvdi.settings import AllocatorSettings, load_settings

SPEC = KVCacheSpec("m", 2, 2, 8, 4, "float32")  # 512 B per block


def test_host_staging_is_not_counted_against_the_device_and_device_staging_is() -> None:
    settings = AllocatorSettings(device="cuda", num_blocks=10, max_staging_bytes=4096)
    fits = 10 * SPEC.block_bytes + 4096  # host staging (64 blocks) would not fit on top: it is not the device's
    plan = plan_allocation(SPEC, settings, "cuda:0", free_bytes=fits)
    assert (plan.staging_bytes, plan.device_staging_bytes) == (64 * SPEC.block_bytes, 4096)
    assert "device staging up to 4096 B" in plan.describe()
    with pytest.raises(AllocationError, match="KVDI_ALLOCATOR__MAX_STAGING_BYTES"):
        plan_allocation(SPEC, settings, "cuda:0", free_bytes=fits - 1)


def test_a_cpu_cache_plans_no_device_staging() -> None:
    plan = plan_allocation(SPEC, AllocatorSettings(num_blocks=10), "cpu", free_bytes=None)
    assert plan.device_staging_bytes == 0


def test_max_staging_bytes_is_bounded_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdi.errors import ConfigError

    monkeypatch.setenv("KVDI_ALLOCATOR__MAX_STAGING_BYTES", "0")
    with pytest.raises(ConfigError, match="KVDI_ALLOCATOR__MAX_STAGING_BYTES"):
        load_settings()


def test_kvdi_info_shows_both_staging_figures(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvdi.cli import main

    monkeypatch.setenv("KVDI_ALLOCATOR__DEVICE", "cpu")
    monkeypatch.setenv("KVDI_ALLOCATOR__NUM_BLOCKS", "8")
    assert main(["info"]) == 0
    assert "host staging 0 B, device staging 0 B" in capsys.readouterr().out


def test_the_cpu_offload_pool_is_never_pinned() -> None:
    from kvdi.connectors.cpu_offload import open_store

    settings = load_settings(kv_connector="cpu_offload", allocator={"pin_memory": True})
    store = open_store(settings.cpu_offload, SPEC, settings)
    assert store._pin is False


def test_a_p2p_fetch_is_split_to_fit_max_staging_bytes() -> None:
    from tests.connectors.test_p2p_cuda_discipline import consumer, source_caches, transfer

    source = source_caches()
    worker, caches, _cuda = consumer(source, max_staging_bytes=SPEC.block_bytes)
    worker.bind_connector_metadata(P2pTransferMetadata(loads=(transfer("r", (1, 5, 9), (2, 3, 4)),)))
    worker.start_load_kv()
    assert worker.channel.fetches == 3  # one block per fetch
    assert worker.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(c[[1, 5, 9]], s[[2, 3, 4]]) for c, s in zip(caches, source, strict=True))
