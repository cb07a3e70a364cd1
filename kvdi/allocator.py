"""Plans and allocates the paged KV cache (CUDA when present, CPU otherwise) and its staging buffers.

:func:`plan_allocation` is pure: from a layout, the allocator settings, the resolved device
and the free bytes it says how many blocks fit and how much staging a device cache needs.
:class:`GpuBufferAllocator` owns the tensors: :meth:`~GpuBufferAllocator.allocate` creates one
tensor per layer of shape ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` (a block of
one layer, K then V, is contiguous); :meth:`~GpuBufferAllocator.staging` hands connectors
their staging buffers (:class:`StagingBuffers`: pinned host memory when the cache is on CUDA
and ``pin_memory`` is on); :meth:`~GpuBufferAllocator.free` releases all of it.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvdi.errors import AllocationError
from kvdi.layout import KVCacheSpec

if TYPE_CHECKING:
    import torch

    from kvdi.settings import AllocatorSettings

DEFAULT_MEMORY_FRACTION = 0.05
STAGING_BLOCKS = 64
"""Host staging planned for a device cache, in blocks: above the store halves' largest chunk."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AllocationPlan:
    """What :meth:`GpuBufferAllocator.allocate` will create, computed without allocating.

    ``staging_bytes`` is the host staging planned for device<->host copies (0 for a CPU
    cache, whose blocks are read and written in place); ``staging_pinned`` says whether it
    is page-locked. It lives in host memory and is never counted against the device.
    ``device_staging_bytes`` is the device memory kvdi may take outside the KV cache on a CUDA
    cache (a p2p NCCL fetch's landing zone, at most ``allocator.max_staging_bytes``); it is
    counted against the device's free memory.
    """

    device: str
    num_blocks: int
    block_bytes: int
    total_bytes: int
    staging_bytes: int
    budget_bytes: int
    budget_source: str
    staging_pinned: bool = False
    device_staging_bytes: int = 0

    def describe(self) -> str:
        gib = self.total_bytes / 2**30
        kind = "pinned" if self.staging_pinned else "pageable"
        device = f", device staging up to {self.device_staging_bytes} B" if self.device_staging_bytes else ""
        return (
            f"{self.num_blocks} blocks x {self.block_bytes} B = {gib:.3f} GiB on {self.device} "
            f"(budget {self.budget_source}); host staging {self.staging_bytes} B {kind}{device}"
        )


def plan_allocation(
    spec: KVCacheSpec, settings: AllocatorSettings, device: str, free_bytes: int | None
) -> AllocationPlan:
    """The plan for ``spec`` on the resolved ``device``; pure (no torch, no memory probe).

    ``free_bytes`` is the device's free memory (needed when ``settings.num_blocks`` is unset; when
    given, a plan larger than it is refused). Raises AllocationError when no block fits the budget
    or the cache would not fit the free memory.
    """
    per_block = spec.block_bytes
    s = settings
    if s.num_blocks is not None:
        num_blocks, budget, source = s.num_blocks, s.num_blocks * per_block, f"num_blocks={s.num_blocks}"
    else:
        fraction = s.memory_fraction if s.memory_fraction is not None else DEFAULT_MEMORY_FRACTION
        if not 0.0 < fraction <= 1.0:
            raise AllocationError(f"allocator.memory_fraction must be in (0, 1], got {fraction}")
        if free_bytes is None:
            raise ValueError("plan_allocation() needs free_bytes when num_blocks is not set")
        budget = int(free_bytes * fraction)
        num_blocks = budget // per_block
        source = f"memory_fraction={fraction} of {free_bytes} B free"
    if num_blocks < 1:
        raise AllocationError(
            f"no KV block fits: one block needs {per_block} B ({spec}), budget is {budget} B "
            f"({source}); raise KVDI_ALLOCATOR__MEMORY_FRACTION or set KVDI_ALLOCATOR__NUM_BLOCKS"
        )
    on_cuda = device.startswith("cuda")
    staging = STAGING_BLOCKS * per_block if on_cuda else 0  # host memory: not the device's
    device_staging = s.max_staging_bytes if on_cuda else 0
    needed = num_blocks * per_block + device_staging
    if free_bytes is not None and needed > free_bytes:
        knob = "NUM_BLOCKS" if s.num_blocks is not None else "MEMORY_FRACTION"
        fix = f"lower KVDI_ALLOCATOR__{knob}" + (" or KVDI_ALLOCATOR__MAX_STAGING_BYTES" if device_staging else "")
        raise AllocationError(
            f"the KV cache plan needs {needed} B ({num_blocks} blocks x {per_block} B, {source}"
            f"{f', device staging {device_staging} B' if device_staging else ''}) but only "
            f"{free_bytes} B are free on {device}; {fix}"
        )
    return AllocationPlan(
        device, num_blocks, per_block, num_blocks * per_block, staging, budget, source, on_cuda and s.pin_memory,
        device_staging,
    )  # fmt: skip


class Staging(Protocol):
    """Where a connector's worker half takes staging buffers: ``staging(nbytes, device=..., owner=...)``."""

    def __call__(
        self, nbytes: int, *, device: str | torch.device = "cpu", owner: str | None = None
    ) -> torch.Tensor: ...


class StagingBuffers:
    """Staging tensors for copies between a cache and another place, created and counted in one place.

    Host buffers (``device="cpu"``) are page-locked when ``pin_memory`` is on and CUDA is
    available; device buffers (e.g. a p2p receiver's NCCL landing zone) live on ``device``.
    A caller that names an ``owner`` holds one buffer per owner: asking again (to grow it)
    replaces the previous one in the count, so :attr:`nbytes` is what is held now.
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._held: dict[str, torch.Tensor] = {}
        self._anonymous = itertools.count(1)  # next() is atomic: background load threads ask at once

    def __call__(self, nbytes: int, *, device: str | torch.device = "cpu", owner: str | None = None) -> torch.Tensor:
        """A new uint8 tensor of exactly ``nbytes`` on ``device`` (uninitialised)."""
        import torch

        if nbytes < 0:
            raise ValueError(f"staging size must be >= 0, got {nbytes}")
        where = torch.device(device)
        pin = where.type == "cpu" and self.pin_memory and torch.cuda.is_available()
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=where, pin_memory=pin)
        except (RuntimeError, MemoryError) as exc:
            raise AllocationError(f"allocating {nbytes} B of staging on {where} failed: {exc}") from exc
        if owner is None:
            owner = f"#{next(self._anonymous)}"
        self._held[owner] = buf
        return buf

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The buffers held now, oldest owner first."""
        return list(self._held.values())

    @property
    def nbytes(self) -> dict[str, int]:
        """Bytes held now per device, e.g. ``{"cpu": 1048576}``."""
        out: dict[str, int] = {}
        for buf in self._held.values():
            out[str(buf.device)] = out.get(str(buf.device), 0) + buf.numel()
        return out

    def free(self) -> None:
        """Drop every buffer handed out (callers must not use them afterwards)."""
        self._held = {}


class GpuBufferAllocator:
    """Owns the paged KV cache tensors of one engine and the staging its connectors use."""

    def __init__(self, spec: KVCacheSpec, settings: AllocatorSettings) -> None:
        self.spec = spec
        self.settings = settings
        self._plan: AllocationPlan | None = None
        self._caches: dict[str, torch.Tensor] = {}
        self._staging = StagingBuffers(pin_memory=False)
        self._over_plan_logged = False

    def plan(self) -> AllocationPlan:
        """Blocks, bytes and device; raises AllocationError if no block fits. Allocates nothing."""
        if self._plan is None:
            device = resolve_device(self.settings.device)
            self._plan = plan_allocation(self.spec, self.settings, device, free_memory_bytes(device))
            self._staging.pin_memory = self._plan.staging_pinned
        return self._plan

    def allocate(self) -> dict[str, torch.Tensor]:
        """Create the per-layer caches (zeroed); idempotent. Staging is created on demand by :meth:`staging`."""
        if self._caches:
            return self._caches
        import torch

        plan = self.plan()
        dtype = getattr(torch, self.spec.dtype)
        shape = (plan.num_blocks, *self.spec.block_shape)
        try:
            for name in self.spec.layer_names:
                self._caches[name] = torch.zeros(shape, dtype=dtype, device=plan.device)
        except (RuntimeError, MemoryError) as exc:
            self.free()
            raise AllocationError(f"allocating {plan.describe()} failed: {exc}") from exc
        return self._caches

    def staging(self, nbytes: int, *, device: str | torch.device = "cpu", owner: str | None = None) -> torch.Tensor:
        """A uint8 staging tensor of ``nbytes`` on ``device``, owned (and freed) by this allocator.

        Host staging is pinned when the cache is on CUDA and ``KVDI_ALLOCATOR__PIN_MEMORY``
        is on. See :class:`StagingBuffers` for ``owner``. Host staging beyond the plan's
        ``staging_bytes`` is allowed and logged once.
        """
        plan = self.plan()
        buf = self._staging(nbytes, device=device, owner=owner)
        host = self._staging.nbytes.get("cpu", 0)
        if host > plan.staging_bytes and not self._over_plan_logged:
            self._over_plan_logged = True
            logger.info("host staging is %d B, above the %d B planned (%s)", host, plan.staging_bytes, plan.describe())
        return buf

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        """The allocated caches by layer name; empty before :meth:`allocate` and after :meth:`free`."""
        return self._caches

    @property
    def staging_buffers(self) -> list[torch.Tensor]:
        """The staging buffers handed out by :meth:`staging` and held now."""
        return self._staging.buffers

    @property
    def staging_nbytes(self) -> dict[str, int]:
        """Staging bytes held now per device."""
        return self._staging.nbytes

    def free(self) -> None:
        """Drop every tensor this allocator created (caches and staging)."""
        self._caches = {}
        self._staging.free()


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
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def allocated(allocator: GpuBufferAllocator) -> Iterator[GpuBufferAllocator]:
    """Resource initializer: allocate, hand the allocator out, free on container shutdown."""
    allocator.allocate()
    try:
        yield allocator
    finally:
        allocator.free()


__all__ = [
    "AllocationPlan",
    "GpuBufferAllocator",
    "Staging",
    "StagingBuffers",
    "allocated",
    "free_memory_bytes",
    "plan_allocation",
    "resolve_device",
]
