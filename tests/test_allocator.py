"""GpuBufferAllocator: plan without allocating, allocate on the resolved device, free, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvdi.allocator import GpuBufferAllocator, resolve_device
from kvdi.containers import build_engine_container
from kvdi.errors import AllocationError
from kvdi.layout import KVCacheSpec
from kvdi.settings import AllocatorSettings

SPEC = KVCacheSpec("m", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def test_plan_counts_blocks_and_bytes_without_allocating() -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cpu", num_blocks=10))
    plan = alloc.plan()
    assert (plan.device, plan.num_blocks, plan.block_bytes) == ("cpu", 10, 3 * 2 * 4 * 2 * 8 * 2)
    assert plan.total_bytes == 10 * plan.block_bytes
    assert alloc.kv_caches == {}


def test_allocate_creates_one_zeroed_tensor_per_layer_in_the_planned_shape() -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cpu", num_blocks=5, dtype="float16"))
    caches = alloc.allocate()
    assert list(caches) == ["layers.0", "layers.1", "layers.2"]
    for t in caches.values():
        assert t.shape == (5, 2, 4, 2, 8) and t.dtype == torch.float16 and t.device.type == "cpu"
        assert not t.any()
        assert t[3].is_contiguous()


def test_no_pinned_staging_without_cuda() -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cpu", num_blocks=5))
    alloc.allocate()
    assert alloc.plan().staging_bytes == 0 and alloc.staging_buffers == []


def test_free_drops_every_tensor() -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cpu", num_blocks=5))
    alloc.allocate()
    alloc.free()
    assert alloc.kv_caches == {}


def test_fraction_budget_uses_free_memory() -> None:
    plan = GpuBufferAllocator(SPEC, AllocatorSettings(device="cpu", memory_fraction=0.001)).plan()
    assert plan.num_blocks >= 1 and "memory_fraction=0.001" in plan.budget_source


def test_zero_blocks_fitting_reports_the_numbers() -> None:
    with pytest.raises(AllocationError, match=r"no KV block fits: one block needs 768 B .* budget is 0 B"):
        GpuBufferAllocator(SPEC, AllocatorSettings(device="cpu", memory_fraction=1e-15)).plan()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_an_allocation_error(device: str) -> None:
    with pytest.raises(AllocationError, match=f"KVDI_ALLOCATOR__DEVICE='{device}' but CUDA is not available"):
        resolve_device(device)


def test_auto_picks_cuda_only_when_present() -> None:
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_and_pinned_staging() -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cuda", num_blocks=5))
    caches = alloc.allocate()
    assert all(t.is_cuda for t in caches.values())
    assert alloc.staging_buffers and all(b.is_pinned() for b in alloc.staging_buffers)


def test_fingerprint_changes_with_every_layout_field() -> None:
    fields = dict(model_id="m", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
    base = KVCacheSpec(**fields).fingerprint()  # type: ignore[arg-type]
    changes = {"model_id": "n", "num_layers": 4, "num_kv_heads": 1, "head_dim": 16, "block_size": 8, "dtype": "float32"}
    for key, value in changes.items():
        assert KVCacheSpec(**{**fields, key: value}).fingerprint() != base, key  # type: ignore[arg-type]


def test_container_allocates_on_first_use_and_frees_on_shutdown(kvdi_env: Path) -> None:
    c = build_engine_container(kv_connector="null", allocator={"device": "cpu", "num_blocks": 8})
    planner = c.alloc.planner()
    assert planner.kv_caches == {}
    alloc = c.alloc.allocator()
    assert alloc is planner and len(alloc.kv_caches) == c.settings().model.num_layers
    c.shutdown_resources()
    assert planner.kv_caches == {}
