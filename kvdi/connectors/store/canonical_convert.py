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


def _groups(sections: Sequence[Section]) -> list[tuple[int, list[Section]]]:
    """``sections`` (layer-major, heads ascending, as the plans list them) by layer group, with each
    group's offset in a buffer holding all of them back to back."""
    groups: list[tuple[int, list[Section]]] = []
    for s in sections:
        if groups and groups[-1][1][0].layer_start == s.layer_start:
            groups[-1][1].append(s)
        else:
            groups.append((0, [s]))
    return groups


def _regions(
    geometry: Geometry, sections: Sequence[Section], buffer: torch.Tensor
) -> list[tuple[list[Section], torch.Tensor]]:
    """Each layer group of ``sections`` with its region of ``buffer`` viewed ``[sections, layers, 2, heads, N, D]``."""
    g, out, offset = geometry, [], 0
    for _, group in _groups(sections):
        first = group[0]
        n = len(group) * g.section_bytes(first) // g.elem_bytes
        shape = (len(group), first.layer_count, 2, first.head_count, g.block_size, g.head_dim)
        out.append((group, buffer[offset : offset + n].view(shape)))
        offset += n
    return out


def pack_block(
    geometry: Geometry, part: RankPart, layers: Sequence[Buffer | torch.Tensor], order: str, sections: Sequence[Section]
) -> bytearray:
    """The payloads of ``sections`` (all inside ``part``; e.g. its write plan) back to back: one strided copy
    per layer, whatever the number of sections."""
    g = geometry
    out = bytearray(sum(g.section_bytes(s) for s in sections))
    flat = as_tensor(out, g.dtype)
    for group, region in _regions(g, sections, flat):
        first, ng, hs = group[0], len(group), group[0].head_count
        h0 = first.head_start - part.head_start
        for i in range(first.layer_count):
            src = kvhtd(as_tensor(layers[first.layer_start - part.layer_start + i], g.dtype), order, part.head_count,
                        g.block_size, g.head_dim)  # fmt: skip
            heads = src[:, h0 : h0 + ng * hs].unflatten(1, (ng, hs)).permute(1, 0, 2, 3, 4)  # type: ignore[no-untyped-call]
            region[:, i].copy_(heads)
    return out


def unpack_block(
    geometry: Geometry,
    part: RankPart,
    layers: Sequence[Buffer | torch.Tensor],
    order: str,
    sections: Sequence[Section],
    payloads: Buffer,
) -> None:
    """Copy what ``part`` holds of ``sections`` (its read plan), whose verified payloads lie back to back in
    ``payloads``, into its writable layer buffers: one strided copy per layer."""
    g = geometry
    flat = as_tensor(payloads, g.dtype)
    for group, region in _regions(g, sections, flat):
        first, last = group[0], group[-1]
        c0, c1 = first.head_start, last.head_start + last.head_count  # heads the group covers
        h0, h1 = max(c0, part.head_start), min(c1, part.head_start + part.head_count)
        l0 = max(first.layer_start, part.layer_start)
        l1 = min(first.layer_start + first.layer_count, part.layer_start + part.layer_count)
        for layer in range(l0, l1):
            src = region[:, layer - first.layer_start].permute(1, 0, 2, 3, 4)  # [2, sections, heads, N, D]
            dst = kvhtd(as_tensor(layers[layer - part.layer_start], g.dtype, True), order, part.head_count,
                        g.block_size, g.head_dim)[:, h0 - part.head_start : h1 - part.head_start]  # fmt: skip
            if (h0, h1) == (c0, c1):  # the sections' heads are all the rank's: no staging
                dst.unflatten(1, (len(group), first.head_count)).copy_(src)  # type: ignore[no-untyped-call]
            else:  # a section wider than the rank's heads (a coarser grid): its heads, through a copy
                dst.copy_(src.flatten(1, 2)[:, h0 - c0 : h1 - c0])


__all__ = ["ORDERS", "as_tensor", "kvhtd", "pack_block", "unpack_block"]
