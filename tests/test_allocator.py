"""GpuBufferAllocator: plan without allocating, allocate on the resolved device, staging, free, clear errors.

The CUDA side (caches on a GPU, pinned staging) is in tests/test_cuda.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvdi.allocator import GpuBufferAllocator, StagingBuffers, plan_allocation, resolve_device
from kvdi.containers import build_engine_container
from kvdi.errors import AllocationError
from kvdi.layout import KVCacheSpec
from kvdi.settings import AllocatorSettings

SPEC = KVCacheSpec("m", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def test_plan_counts_blocks_and_bytes_without_allocating() -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cpu", num_blocks=10))
    plan = alloc.plan()
    # one block: 3 layers x (K, V) x 4 tokens x 2 heads x 8 dims x 2 bytes (float16) = 768 B
    assert (plan.device, plan.num_blocks, plan.block_bytes, plan.total_bytes) == ("cpu", 10, 768, 7680)
    assert alloc.kv_caches == {}


def test_allocate_creates_one_zeroed_tensor_per_layer_in_the_planned_shape() -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cpu", num_blocks=5, dtype="float16"))
    caches = alloc.allocate()
    assert list(caches) == ["layers.0", "layers.1", "layers.2"]
    for t in caches.values():
        assert t.shape == (5, 2, 4, 2, 8) and t.dtype == torch.float16 and t.device.type == "cpu"
        assert not t.any()
        assert t[3].is_contiguous()


def test_a_cpu_cache_plans_no_staging_and_allocates_none_up_front() -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cpu", num_blocks=5))
    alloc.allocate()
    assert alloc.plan().staging_bytes == 0 and alloc.staging_buffers == []


def test_a_cuda_plan_reserves_64_blocks_of_staging_pinned_only_if_asked() -> None:
    settings = AllocatorSettings(device="cuda", num_blocks=5)
    plan = plan_allocation(SPEC, settings, "cuda:0", free_bytes=None)
    assert (plan.staging_bytes, plan.staging_pinned) == (64 * 768, True)
    unpinned = plan_allocation(SPEC, settings.model_copy(update={"pin_memory": False}), "cuda:0", None)
    assert (unpinned.staging_bytes, unpinned.staging_pinned) == (64 * 768, False)


def test_planning_is_pure_arithmetic_over_the_free_bytes_given() -> None:
    plan = plan_allocation(SPEC, AllocatorSettings(memory_fraction=0.5), "cpu", free_bytes=10_000)
    assert (plan.budget_bytes, plan.num_blocks, plan.total_bytes) == (5_000, 6, 4_608)
    assert plan.budget_source == "memory_fraction=0.5 of 10000 B free"


def test_staging_is_handed_out_counted_and_freed_by_the_allocator() -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cpu", num_blocks=5))
    alloc.allocate()
    a = alloc.staging(1000)
    b = alloc.staging(24, owner="p2p")
    assert (a.dtype, a.numel(), a.device.type, b.numel()) == (torch.uint8, 1000, "cpu", 24)
    assert alloc.staging_nbytes == {"cpu": 1024}
    alloc.staging(4096, owner="p2p")  # growing an owner's buffer replaces it in the count
    assert alloc.staging_nbytes == {"cpu": 5096} and len(alloc.staging_buffers) == 2
    alloc.free()
    assert alloc.staging_nbytes == {} and alloc.staging_buffers == []


def test_host_staging_is_not_pinned_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not StagingBuffers(pin_memory=True)(64).is_pinned()


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


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_an_allocation_error(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AllocationError, match=f"KVDI_ALLOCATOR__DEVICE='{device}' but CUDA is not available"):
        resolve_device(device)


def test_a_cuda_index_past_the_last_device_is_an_allocation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(AllocationError, match=r"'cuda:1' but only 1 CUDA device\(s\) exist"):
        resolve_device("cuda:1")


def test_auto_picks_cuda_only_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    for present, expected in ((True, "cuda"), (False, "cpu")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda present=present: present)
        assert resolve_device("auto") == expected


def test_container_allocates_on_first_use_and_frees_on_shutdown(kvdi_env: Path) -> None:
    c = build_engine_container(kv_connector="null", allocator={"device": "cpu", "num_blocks": 8})
    planner = c.alloc.planner()
    assert planner.kv_caches == {}
    alloc = c.alloc.allocator()
    assert alloc is planner and len(alloc.kv_caches) == c.settings().model.num_layers
    c.shutdown_resources()
    assert planner.kv_caches == {}
