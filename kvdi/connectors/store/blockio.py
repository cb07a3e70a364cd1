"""Byte views of the paged KV cache for the store halves: where a block's frame is read from and written to.

A block of one layer (``cache[block_id]``, K then V) is contiguous, so one stored payload is
``num_layers`` contiguous pieces. On a CPU cache the pieces are views of the cache itself:
saves write straight from it and loads read straight into it (no staging copy). On a device
cache, blocks bounce through a host staging buffer taken from the engine's allocator
(:meth:`kvdi.allocator.GpuBufferAllocator.staging`: pinned when the cache is on CUDA and
``KVDI_ALLOCATOR__PIN_MEMORY`` is on); its copies are ordered against the engine's CUDA stream
by :mod:`kvdi.connectors.streams` (events, a fenced side stream for background jobs, no
device-wide synchronize).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvdi.connectors.streams import StreamOrder, order_for

if TYPE_CHECKING:
    import torch

    from kvdi.allocator import Staging
    from kvdi.connectors.store.framing import Buffer


def scatter(src: Buffer | np.ndarray, pieces: Sequence[Buffer]) -> None:
    """Copy the contiguous bytes ``src`` into the writable ``pieces`` in order (``src`` holds at least their sum).

    Byte-wise memoryview assignment: one ``memcpy`` per piece with far less per-call overhead
    than a numpy copy (it matters: a block is tens of pieces, one per layer).
    """
    flat = (src.reshape(-1).view(np.uint8).data if isinstance(src, np.ndarray) else memoryview(src)).cast("B")
    offset = 0
    for piece in pieces:
        dst = piece if isinstance(piece, memoryview) and piece.format == "B" else memoryview(piece).cast("B")
        end = offset + dst.nbytes
        dst[:] = flat[offset:end]
        offset = end


def gather(pieces: Sequence[memoryview], dst: memoryview) -> None:
    """Copy the 1-D byte views ``pieces`` back to back into ``dst`` (which holds at least their sum)."""
    offset = 0
    for piece in pieces:
        end = offset + piece.nbytes
        dst[offset:end] = piece
        offset = end


class CacheIO:
    """Per-layer uint8 views of the caches, plus staging for device caches."""

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        layer_bytes: int,
        chunk: int,
        staging: bool | None = None,
        buffers: Staging | None = None,
        order: StreamOrder | None = None,
        owner: str | None = None,
    ) -> None:
        """``staging`` forces (True) or forbids (False) the host bounce; None: only for non-CPU caches.

        ``buffers`` is where the staging rows come from (the worker half's
        ``context.staging``); None: a private :class:`~kvdi.allocator.StagingBuffers`. ``owner``
        names the staging buffer there (asking again under the same owner replaces it).
        ``order`` orders the copies of a CUDA cache against the engine's stream
        (:mod:`kvdi.connectors.streams`); None: :func:`~kvdi.connectors.streams.order_for` the cache's device.
        """
        import torch

        if not caches:
            raise ValueError("register_kv_caches() got no cache tensors")
        first = caches[0]
        self.num_blocks = int(first.shape[0])
        self.layer_bytes = layer_bytes
        self._u8: list[torch.Tensor] = []
        for t in caches:
            if not t.is_contiguous() or t.device != first.device or int(t.shape[0]) != self.num_blocks:
                raise ValueError("cache tensors must be contiguous, on one device, with the same number of blocks")
            if t[0].numel() * t.element_size() != layer_bytes:
                raise ValueError(
                    f"a cache block of shape {tuple(t.shape[1:])} ({t.dtype}) is not {layer_bytes} B: "
                    "the cache does not match the connector's KV layout"
                )
            self._u8.append(t.view(torch.uint8).view(self.num_blocks, layer_bytes))
        self.direct = first.device.type == "cpu" if staging is None else not staging
        self.order = order if order is not None else order_for(first.device)
        # Flat byte views of each layer: a block's piece is a slice (cheaper than indexing an array per call).
        self._flat = [u.numpy().reshape(-1).data.cast("B") for u in self._u8] if self.direct else []
        self._staging: torch.Tensor | None = None
        self._staging_np: np.ndarray | None = None
        if not self.direct:
            if buffers is None:
                from kvdi.allocator import StagingBuffers

                buffers = StagingBuffers(pin_memory=first.device.type == "cuda")
            row_bytes = layer_bytes * len(caches)
            self._staging = buffers(chunk * row_bytes, owner=owner).view(chunk, row_bytes)
            self._staging_np = self._staging.numpy()

    def _row_pieces(self, i: int) -> list[memoryview]:
        assert self._staging_np is not None
        row, lb = self._staging_np[i], self.layer_bytes
        return [memoryview(row[l * lb : (l + 1) * lb]) for l in range(len(self._u8))]  # noqa: E741

    def load_pieces(self, i: int, block_id: int) -> list[memoryview]:
        """Where the ``i``-th block of a chunk is read into: the cache block itself, or staging row ``i``."""
        if self.direct:
            start = block_id * self.layer_bytes
            return [m[start : start + self.layer_bytes] for m in self._flat]
        return self._row_pieces(i)

    @staticmethod
    def copy_payload(payload: memoryview, pieces: Sequence[memoryview]) -> None:
        """Copy a verified contiguous payload into ``pieces`` in order."""
        scatter(payload, pieces)

    def commit_load(self, i: int, block_id: int) -> None:
        """Make a loaded block visible in the cache (device caches: start the host-to-device copy)."""
        if self.direct:
            return
        assert self._staging is not None
        row, lb = self._staging[i], self.layer_bytes
        for l, u in enumerate(self._u8):  # noqa: E741
            self._copy(u[block_id], row[l * lb : (l + 1) * lb])

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One staging copy: asynchronous on the current stream of a CUDA cache (see :meth:`finish`)."""
        if self.order is not None:
            self.order.copy(dst, src)
        else:
            dst.copy_(src, non_blocking=True)

    def finish(self) -> None:
        """Wait for this thread's queued copies (before staging rows are read or reused): on the event
        after them on the current stream, never a device-wide synchronize."""
        if self.order is not None:
            self.order.wait()

    def fence(self) -> object:
        """On the engine thread, before handing a load to the background: what the job's copies must
        follow (the compute queued so far on the current stream); None for a CPU cache."""
        return self.order.fence() if self.order is not None else None

    def on_side_stream(self, fence: object) -> contextlib.AbstractContextManager[object]:
        """Background jobs run their copies inside this: on the side stream, after ``fence`` only."""
        return self.order.side(fence) if self.order is not None else contextlib.nullcontext()

    def save_pieces(self, block_ids: Sequence[int]) -> list[list[memoryview]]:
        """The payload pieces of each block, valid until the next call."""
        if self.direct:
            lb = self.layer_bytes
            return [[m[b * lb : (b + 1) * lb] for m in self._flat] for b in block_ids]
        assert self._staging is not None
        lb = self.layer_bytes
        for i, b in enumerate(block_ids):
            row = self._staging[i]
            for l, u in enumerate(self._u8):  # noqa: E741
                self._copy(row[l * lb : (l + 1) * lb], u[b])
        self.finish()
        return [self._row_pieces(i) for i in range(len(block_ids))]


class CacheIOs:
    """The cache access of one ``register_kv_caches`` and the staging :class:`CacheIO` s its background jobs take.

    A job takes a CacheIO of its own (:meth:`take`: on a CPU cache the shared one, on a device
    cache one with private host staging, reused job after job) and gives it back when done
    (:meth:`give_back`). A new registration makes a new ``CacheIOs``: jobs still running on the
    old one give their CacheIO back to the old object, which the worker no longer holds, so no
    new job ever copies into the caches of an earlier registration and the old caches and
    staging die with the last such job. The staging buffers are named ``<owner>/cache`` and
    ``<owner>/job<k>`` in ``buffers``, so the next registration's buffers replace them in the
    allocator's count instead of adding to it.
    """

    def __init__(
        self, caches: Sequence[torch.Tensor], layer_bytes: int, chunk: int, buffers: Staging | None, owner: str,
        staging: bool | None = None,
    ) -> None:  # fmt: skip
        self.caches = list(caches)
        self._args = (layer_bytes, chunk, buffers, owner, staging)
        self.io = CacheIO(self.caches, layer_bytes, chunk, staging=staging, buffers=buffers, owner=f"{owner}/cache")
        self._free: list[CacheIO] = []
        self._made = itertools.count()  # next() is atomic: load jobs take from their own threads

    def take(self) -> CacheIO:
        """Cache access for one background job: the cache itself (CPU) or a staging buffer of its own."""
        if self.io.direct:
            return self.io
        try:
            return self._free.pop()
        except IndexError:
            layer_bytes, chunk, buffers, owner, _ = self._args
            name = f"{owner}/job{next(self._made)}"
            return CacheIO(self.caches, layer_bytes, chunk, staging=True, buffers=buffers, owner=name)

    def give_back(self, io: CacheIO) -> None:
        """A job is done with ``io`` (from :meth:`take`)."""
        if io is not self.io:
            self._free.append(io)

    @property
    def idle(self) -> int:
        """Job CacheIOs given back and not taken again."""
        return len(self._free)


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
