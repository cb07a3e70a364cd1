"""Copies between a rank's block in its engine's byte order and canonical section payloads (``LKHTD``).

A rank's block is one buffer per layer it holds (its KV heads only), in one of the stored block
orders of :mod:`kvdi.integrations.vllm.views`: kvdi's ``""`` (``[2, N, H, D]``), ``"nhc"``
(``[N, H, 2D]``) or ``"hnc"`` (``[H, N, 2D]``). A section payload is, per layer, K then V, per
head, ``N`` tokens of ``D`` elements. Each copy here is one strided torch copy per layer; nothing
is converted through Python lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvdi.connectors.store.canonical import Geometry, RankPart, Section
from kvdi.connectors.store.framing import Buffer

_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ORDERS = ("", "nhc", "hnc")


def as_tensor(buf: Buffer | torch.Tensor, dtype: str, writable: bool = False) -> torch.Tensor:
    """``buf`` (bytes-like, or any contiguous tensor) reinterpreted as a flat tensor of ``dtype``; no copy
    (a read-only buffer is copied once, or refused with ValueError when ``writable``)."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError(f"a layer buffer of shape {tuple(buf.shape)} is not contiguous; pass a contiguous one")
        return buf.reshape(-1).view(torch.uint8).view(_TORCH[dtype])
    view = memoryview(buf).cast("B")
    if view.readonly:
        if writable:
            raise ValueError("a destination layer buffer is read-only; pass a writable buffer or tensor")
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8).view(_TORCH[dtype])


def kvhtd(layer: torch.Tensor, order: str, heads: int, block_size: int, head_dim: int) -> torch.Tensor:
    """A view ``[2, H, N, D]`` of one layer's block (flat, in ``order``): element ``[kv, h, t, d]``."""
    if order == "":
        return layer.view(2, block_size, heads, head_dim).permute(0, 2, 1, 3)
    if order == "nhc":
        return layer.view(block_size, heads, 2, head_dim).permute(2, 1, 0, 3)
    if order == "hnc":
        return layer.view(heads, block_size, 2, head_dim).permute(2, 0, 1, 3)
    raise ValueError(f"order={order!r} is not a stored block order; allowed: {', '.join(repr(o) for o in ORDERS)}")


def _payload(geometry: Geometry, section: Section, payload: torch.Tensor) -> torch.Tensor:
    g = geometry
    return payload.view(section.layer_count, 2, section.head_count, g.block_size, g.head_dim)


def pack_section(
    geometry: Geometry, part: RankPart, layers: Sequence[Buffer | torch.Tensor], order: str, section: Section
) -> bytearray:
    """The payload of ``section`` (wholly inside ``part``) from the rank's per-layer block buffers ``layers``."""
    g = geometry
    out = bytearray(g.section_bytes(section))
    dst = _payload(g, section, as_tensor(out, g.dtype))
    h0 = section.head_start - part.head_start
    for i in range(section.layer_count):
        src = as_tensor(layers[section.layer_start - part.layer_start + i], g.dtype)
        view = kvhtd(src, order, part.head_count, g.block_size, g.head_dim)
        dst[i].copy_(view[:, h0 : h0 + section.head_count])
    return out


def unpack_section(
    geometry: Geometry,
    part: RankPart,
    layers: Sequence[Buffer | torch.Tensor],
    order: str,
    section: Section,
    payload: Buffer,
) -> None:
    """Copy the part of ``section``'s (verified) payload that ``part`` holds into its writable layer buffers."""
    g = geometry
    src = _payload(g, section, as_tensor(payload, g.dtype))
    l0, l1 = (
        max(section.layer_start, part.layer_start),
        min(section.layer_start + section.layer_count, part.layer_start + part.layer_count),
    )
    h0, h1 = (
        max(section.head_start, part.head_start),
        min(section.head_start + section.head_count, part.head_start + part.head_count),
    )
    for layer in range(l0, l1):
        layer_dst = as_tensor(layers[layer - part.layer_start], g.dtype, True)
        dst = kvhtd(layer_dst, order, part.head_count, g.block_size, g.head_dim)
        piece = src[layer - section.layer_start][:, h0 - section.head_start : h1 - section.head_start]
        dst[:, h0 - part.head_start : h1 - part.head_start].copy_(piece)


__all__ = ["ORDERS", "as_tensor", "kvhtd", "pack_section", "unpack_section"]
