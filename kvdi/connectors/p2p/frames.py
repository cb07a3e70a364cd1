"""Moving framed blocks between the paged KV cache and the wire layout of the p2p connector.

A layer's cache is ``[num_blocks, 2, block_size, kv_heads, head_dim]``, so one block of one
layer is contiguous. The wire layout (:class:`~kvdi.connectors.p2p.held.Frames`) sends
layer ``l`` of all blocks of a fetch as one message: when the consumer's target blocks are
consecutive, that message lands straight in ``cache_l[first:first + count]`` (no copy);
otherwise in a reusable staging buffer taken from the engine's allocator (``context.staging``),
then one ``index_copy_`` per layer. Each block is checked against its frame header (layout
fingerprint, the block key asked for, length, xxh3 of all its layers; with ``KVDI_INTEGRITY_KEY``
the frame's keyed MAC instead), hashed layer by layer as the layers arrive. Parts received on
the device (NCCL) are hashed from one reused host buffer of the allocator (pinned on a CUDA
engine), copied on the receiving thread's current stream and waited for on an event, never a
pageable ``.cpu()`` per part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvdi.connectors.p2p.held import Frames
from kvdi.connectors.store.framing import HEADER_SIZE, CorruptObjectError, FrameKey, PayloadHasher, frame_header

if TYPE_CHECKING:
    import torch

    from kvdi.allocator import Staging
    from kvdi.connectors.streams import StreamOrder
    from kvdi.layout import KVCacheSpec


def gather_frames(
    caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    layout: KVCacheSpec,
    key: FrameKey | None = None,
    *,
    names: Sequence[bytes],
) -> Frames:
    """Copy blocks out of the paged caches into host frames (one copy per layer, then the headers of the
    block keys ``names``, MACed with ``key``). The frames own their bytes: the cache blocks may be reused
    as soon as this returns."""
    import torch

    n, lb = len(block_ids), layout.layer_block_bytes
    if len(names) != n:
        raise ValueError(f"{n} blocks need {n} names, got {len(names)}")
    layers = torch.empty((len(caches), n * lb), dtype=torch.uint8)
    ids = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
    for layer, cache in enumerate(caches):
        dst = layers[layer].view(cache.dtype).view(n, *cache.shape[1:])
        if cache.device.type == "cpu":
            torch.index_select(cache, 0, ids, out=dst)
        else:
            dst.copy_(cache.index_select(0, ids))
    headers = np.empty(n * HEADER_SIZE, dtype=np.uint8)
    raw = layers.numpy()
    fingerprint = layout.fingerprint()
    for i in range(n):
        pieces = [raw[layer, i * lb : (i + 1) * lb].data for layer in range(len(caches))]
        header = frame_header(fingerprint, pieces, key, name=names[i])
        headers[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] = np.frombuffer(header, dtype=np.uint8)
    return Frames(layers, torch.from_numpy(headers))


class CacheReceiver:
    """The consumer's side: receive buffers over the paged cache, scatter and verification.

    ``staging`` is where staging buffers come from (the worker half's ``context.staging``, one
    buffer per layer, owned ``p2p-receiver/<layer>``); None: a private
    :class:`~kvdi.allocator.StagingBuffers` (a standalone channel with no allocator).
    ``key``: the integrity key every received frame must be MACed with (None: xxh3 checksums).
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        layout: KVCacheSpec,
        wire_device: torch.device,
        staging: Staging | None = None,
        key: FrameKey | None = None,
        order: StreamOrder | None = None,
    ) -> None:
        """``order`` orders the device-to-host copies of parts to hash against the receiving stream
        (:mod:`kvdi.connectors.streams`); None: a synchronous copy."""
        import torch

        if staging is None:
            from kvdi.allocator import StagingBuffers

            staging = StagingBuffers(pin_memory=False)
        self.staging = staging
        self.key = key
        self.layout = layout
        self.caches = list(caches)
        self.layer_bytes = layout.layer_block_bytes
        self.wire_device = wire_device
        for cache in self.caches:
            if not cache.is_contiguous():
                raise ValueError("p2p needs contiguous KV cache tensors")
        self._u8 = [c.view(torch.uint8).view(c.shape[0], self.layer_bytes) for c in self.caches]
        self.direct_ok = all(c.device == wire_device for c in self.caches)
        self._staging: list[torch.Tensor] = []
        self.order = order
        self._host: torch.Tensor | None = None  # where device parts are copied to be hashed

    def host_bytes(self, part: torch.Tensor) -> np.ndarray:
        """The bytes of a received part on the host: the part itself (CPU), or a copy into the reused host
        buffer (valid until the next call: the part is hashed before the next one is copied)."""
        if part.device.type == "cpu":
            return part.numpy()
        n = part.numel()
        if self._host is None or self._host.numel() < n:
            self._host = self.staging(n, owner="p2p-receiver/host")  # pinned when the engine's cache is on CUDA
        host = self._host[:n]
        if self.order is None:
            host.copy_(part)
        else:
            self.order.copy(host, part)
            self.order.wait()
        return host.numpy()

    def buffers(self, targets: Sequence[int]) -> tuple[list[torch.Tensor], bool]:
        """Where each layer's message for blocks ``targets`` is received, and whether that is the cache itself."""
        k = len(targets)
        first = targets[0]
        if self.direct_ok and list(targets) == list(range(first, first + k)):
            return [u8[first : first + k].view(-1) for u8 in self._u8], True
        need = k * self.layer_bytes
        if not self._staging or self._staging[0].numel() < need:
            self._staging = [
                self.staging(need, device=self.wire_device, owner=f"p2p-receiver/{i}") for i in range(len(self.caches))
            ]
        return [s[:need] for s in self._staging], False

    def receiving(
        self, buffers: Sequence[torch.Tensor], targets: Sequence[int], direct: bool, names: Sequence[bytes]
    ) -> LayerSink:
        """What to do with each layer as it arrives: hash it per block, and copy it into the cache if staged.
        ``names``: the block keys asked for, one per target (each frame must name its own)."""
        return LayerSink(self, buffers, targets, direct, names)


class LayerSink:
    """Per-layer work of one fetch, done while later layers are still on the wire."""

    def __init__(
        self,
        receiver: CacheReceiver,
        buffers: Sequence[torch.Tensor],
        targets: Sequence[int],
        direct: bool,
        names: Sequence[bytes],
    ) -> None:
        import torch

        if len(names) != len(targets):
            raise ValueError(f"{len(targets)} target blocks need {len(targets)} names, got {len(names)}")
        self.names = list(names)

        self.receiver = receiver
        self.buffers = buffers
        self.direct = direct
        self._ids = torch.tensor(targets, dtype=torch.long, device=receiver.caches[0].device)
        self._hashers = [PayloadHasher(receiver.key) for _ in targets]

    def __call__(self, layer: int, first: int, stop: int) -> None:
        """Blocks ``[first, stop)`` of ``layer`` arrived: update their checksums, place them if staged."""
        lb = self.receiver.layer_bytes
        part = self.buffers[layer][first * lb : stop * lb]
        host = self.receiver.host_bytes(part)
        for i in range(stop - first):
            self._hashers[first + i].update(host[i * lb : (i + 1) * lb].data)
        if not self.direct:
            cache = self.receiver.caches[layer]
            src = part.to(cache.device, non_blocking=True).view(cache.dtype).view(stop - first, *cache.shape[1:])
            cache.index_copy_(0, self._ids[first:stop], src)

    def verdicts(self, headers: torch.Tensor) -> list[CorruptObjectError | None]:
        """After every layer arrived: each block checked against its frame header; None where intact."""
        head = headers.numpy()
        fingerprint, size = self.receiver.layout.fingerprint(), self.receiver.layout.block_bytes
        out: list[CorruptObjectError | None] = []
        for i, hasher in enumerate(self._hashers):
            try:
                hasher.verify(head[i * HEADER_SIZE : (i + 1) * HEADER_SIZE].data, fingerprint, size, name=self.names[i])
                out.append(None)
            except CorruptObjectError as exc:
                out.append(exc)
        return out


__all__ = ["CacheReceiver", "LayerSink", "gather_frames"]
