"""Plans and allocates the paged KV cache: CUDA when present, CPU otherwise.

:class:`GpuBufferAllocator` plans first (:meth:`~GpuBufferAllocator.plan` imports torch only
to look at the device and never allocates), then :meth:`~GpuBufferAllocator.allocate`
creates one tensor per layer of shape ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(a block of one layer, K then V, is contiguous), plus pinned host staging buffers when the
cache lives on CUDA. :meth:`~GpuBufferAllocator.free` releases everything.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvdi.errors import AllocationError

if TYPE_CHECKING:
    import torch

    from kvdi.settings import AllocatorSettings, KvdiSettings

FORMAT_VERSION = 1
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DEFAULT_MEMORY_FRACTION = 0.05
STAGING_BLOCKS = 64


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged KV cache; also the layout that stored KV must match."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @classmethod
    def from_settings(cls, settings: KvdiSettings) -> KVCacheSpec:
        m, a = settings.model, settings.allocator
        return cls(m.model_id, m.num_layers, m.num_kv_heads, m.head_dim, a.block_size, a.dtype)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Names of the per-layer cache tensors, in forward order."""
        return tuple(f"layers.{i}" for i in range(self.num_layers))

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block of one layer: ``(2, block_size, num_kv_heads, head_dim)``."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers: the payload of one stored object."""
        return self.layer_block_bytes * self.num_layers

    def fingerprint(self) -> bytes:
        """16 bytes that change whenever any layout field or the kvdi format version changes."""
        text = "|".join(
            str(v)
            for v in (
                self.model_id,
                self.dtype,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                FORMAT_VERSION,
            )
        )
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass(frozen=True)
class AllocationPlan:
    """What :meth:`GpuBufferAllocator.allocate` will create, computed without allocating."""

    device: str
    num_blocks: int
    block_bytes: int
    total_bytes: int
    staging_bytes: int
    budget_bytes: int
    budget_source: str

    def describe(self) -> str:
        gib = self.total_bytes / 2**30
        return (
            f"{self.num_blocks} blocks x {self.block_bytes} B = {gib:.3f} GiB on {self.device} "
            f"(budget {self.budget_source}); staging {self.staging_bytes} B pinned"
        )


class GpuBufferAllocator:
    """Owns the paged KV cache tensors of one engine."""

    def __init__(self, spec: KVCacheSpec, settings: AllocatorSettings) -> None:
        self.spec = spec
        self.settings = settings
        self._plan: AllocationPlan | None = None
        self._caches: dict[str, torch.Tensor] = {}
        self._staging: list[torch.Tensor] = []

    def plan(self) -> AllocationPlan:
        """Blocks, bytes and device; raises AllocationError if no block fits. Allocates nothing."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def _make_plan(self) -> AllocationPlan:
        device = resolve_device(self.settings.device)
        per_block = self.spec.block_bytes
        s = self.settings
        if s.num_blocks is not None:
            num_blocks, budget, source = s.num_blocks, s.num_blocks * per_block, f"num_blocks={s.num_blocks}"
        else:
            fraction = s.memory_fraction if s.memory_fraction is not None else DEFAULT_MEMORY_FRACTION
            if not 0.0 < fraction <= 1.0:
                raise AllocationError(f"allocator.memory_fraction must be in (0, 1], got {fraction}")
            free = free_memory_bytes(device)
            budget = int(free * fraction)
            num_blocks = budget // per_block
            source = f"memory_fraction={fraction} of {free} B free"
        if num_blocks < 1:
            raise AllocationError(
                f"no KV block fits: one block needs {per_block} B ({self.spec}), budget is {budget} B "
                f"({source}); raise KVDI_ALLOCATOR__MEMORY_FRACTION or set KVDI_ALLOCATOR__NUM_BLOCKS"
            )
        on_cuda = device.startswith("cuda")
        staging = STAGING_BLOCKS * per_block if on_cuda and s.pin_memory else 0
        return AllocationPlan(device, num_blocks, per_block, num_blocks * per_block, staging, budget, source)

    def allocate(self) -> dict[str, torch.Tensor]:
        """Create the per-layer caches (zeroed) and staging buffers; idempotent."""
        if self._caches:
            return self._caches
        import torch

        plan = self.plan()
        dtype = getattr(torch, self.spec.dtype)
        shape = (plan.num_blocks, *self.spec.block_shape)
        try:
            for name in self.spec.layer_names:
                self._caches[name] = torch.zeros(shape, dtype=dtype, device=plan.device)
            if plan.staging_bytes:
                self._staging.append(torch.empty(plan.staging_bytes, dtype=torch.uint8, pin_memory=True))
        except (RuntimeError, MemoryError) as exc:
            self.free()
            raise AllocationError(f"allocating {plan.describe()} failed: {exc}") from exc
        return self._caches

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        """The allocated caches by layer name; empty before :meth:`allocate` and after :meth:`free`."""
        return self._caches

    @property
    def staging_buffers(self) -> list[torch.Tensor]:
        """Pinned host buffers for device<->host copies (only when the cache is on CUDA)."""
        return self._staging

    def free(self) -> None:
        """Drop every tensor this allocator created."""
        self._caches = {}
        self._staging = []


def resolve_device(device: str) -> str:
    """Turn ``auto`` into ``cuda`` or ``cpu``; raise AllocationError for CUDA asked without CUDA."""
    if device == "cpu":
        return "cpu"
    import torch

    has_cuda = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if has_cuda else "cpu"
    if not has_cuda:
        raise AllocationError(f"KVDI_ALLOCATOR__DEVICE={device!r} but CUDA is not available; use 'auto' or 'cpu'")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise AllocationError(
            f"KVDI_ALLOCATOR__DEVICE={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist"
        )
    return device


def free_memory_bytes(device: str) -> int:
    """Free bytes on ``device``: CUDA's free memory, or MemAvailable of the host."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def allocated(allocator: GpuBufferAllocator):  # type: ignore[no-untyped-def]
    """Resource initializer: allocate, hand the allocator out, free on container shutdown."""
    allocator.allocate()
    try:
        yield allocator
    finally:
        allocator.free()
