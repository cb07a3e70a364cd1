"""Copies between a rank's block in its engine's byte order and canonical section payloads (``LNHKD``).

A rank's block is one buffer per layer it holds (its KV heads only), in one of the stored block
orders of :mod:`kvdi.integrations.vllm.views`: kvdi's ``""`` (``[2, N, H, D]``), ``"nhc"``
(``[N, H, 2D]``) or ``"hnc"`` (``[H, N, 2D]``). A section payload is, per layer, per token, per head
of the section, K then V of ``D`` elements: ``nhc``'s own order, so where a section's bytes of a layer
are one run of the engine's buffer (:func:`direct_runs`: ``nhc`` with a section of all the rank's
heads, ``hnc`` with a section a head) they are written from and read into the cache as they are,
with no conversion at all. Otherwise each copy here is one strided numpy copy per layer, whatever
the number of sections or heads, of whole words: a head's ``D`` elements are never split by any
order, so they are copied as 8-byte words where ``D x element bytes`` allows (the dtype does not
matter to a copy; about a plain copy's speed, where element-wise copies of 2-byte halves are several
times slower). Nothing is converted through Python lists.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from kvdi.connectors.store.canonical import Geometry, RankPart, Section
from kvdi.connectors.store.framing import Buffer

ORDERS = ("", "nhc", "hnc")


@functools.lru_cache(maxsize=64)
def word_of(geometry: Geometry) -> np.dtype:
    """The widest unsigned word (8, 4, 2 or 1 bytes) dividing one head's token (``head_dim`` elements)."""
    run = geometry.head_dim * geometry.elem_bytes
    return np.dtype(f"u{next(w for w in (8, 4, 2, 1) if run % w == 0)}")


def as_words(buf: Buffer | torch.Tensor, word: np.dtype, writable: bool = False) -> np.ndarray:
    """``buf`` (bytes-like, or any contiguous CPU tensor) as a flat array of ``word`` s; no copy. Raises
    ValueError for a non-contiguous tensor, or a read-only buffer when ``writable``."""
    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ValueError(f"a layer buffer of shape {tuple(buf.shape)} is not contiguous; pass a contiguous one")
        return buf.detach().reshape(-1).view(torch.uint8).numpy().view(word)
    view = memoryview(buf).cast("B")
    if view.readonly and writable:
        raise ValueError("a destination layer buffer is read-only; pass a writable buffer or tensor")
    return np.frombuffer(view, dtype=np.uint8).view(word)


def layer_bytes(buf: Buffer | torch.Tensor, writable: bool = False) -> memoryview:
    """``buf`` (bytes-like, or any contiguous CPU tensor) as a flat byte view; no copy."""
    if isinstance(buf, memoryview) and buf.format == "B" and buf.ndim == 1 and buf.contiguous:
        if writable and buf.readonly:
            raise ValueError("a destination layer buffer is read-only; pass a writable buffer or tensor")
        return buf
    return memoryview(as_words(buf, np.dtype("u1"), writable).data).cast("B")


def nhkw(layer: np.ndarray, order: str, heads: int, block_size: int, per: int = 1) -> np.ndarray:
    """A view ``[N, H / per, per, 2, W]`` of one layer's block (flat words, in ``order``): element
    ``[t, g, h, kv]`` is head ``g * per + h``'s token ``t`` (``W`` words). Reshapes of the contiguous layer
    only, so always a view (``per`` must divide ``heads``)."""
    view: np.ndarray
    if order == "":
        view = layer.reshape(2, block_size, heads // per, per, -1).transpose(1, 2, 3, 0, 4)
    elif order == "nhc":
        view = layer.reshape(block_size, heads // per, per, 2, -1)
    elif order == "hnc":
        view = layer.reshape(heads // per, per, block_size, 2, -1).transpose(2, 0, 1, 3, 4)
    else:
        raise ValueError(f"order={order!r} is not a stored block order; allowed: {', '.join(map(repr, ORDERS))}")
    return view


def direct_runs(geometry: Geometry, part: RankPart, order: str, sections: Sequence[Section]) -> list[int] | None:
    """Where each of ``sections`` lies in the buffer of each layer it covers, when that is one run: its byte
    offset in the layer's buffer (the run is the section's bytes of one layer); None when any is not.

    Found from the addresses themselves (each word of a layer numbered, viewed in canonical order), so it
    holds for any order and grid: ``nhc`` with a section of all the rank's heads, ``hnc`` with one head."""
    g = geometry
    p = part
    if any(
        s.head_start < p.head_start or s.head_start + s.head_count > p.head_start + p.head_count
        or s.layer_start < p.layer_start or s.layer_start + s.layer_count > p.layer_start + p.layer_count
        for s in sections
    ):  # fmt: skip
        return None  # a section wider than the rank's heads or layers
    word = word_of(g)
    per_layer = g.block_size * part.head_count * 2 * g.head_dim * g.elem_bytes // word.itemsize
    addresses = nhkw(np.arange(per_layer), order, part.head_count, g.block_size)
    out = []
    for s in sections:
        run = addresses[:, s.head_start - p.head_start : s.head_start + s.head_count - p.head_start].ravel()
        if run[-1] - run[0] != run.size - 1 or np.any(np.diff(run) != 1):
            return None
        out.append(int(run[0]) * word.itemsize)
    return out


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
    geometry: Geometry, sections: Sequence[Section], buffer: np.ndarray
) -> list[tuple[list[Section], np.ndarray]]:
    """Each layer group of ``sections`` with its region of ``buffer`` (words) viewed
    ``[sections, layers, N, heads, 2, W]``."""
    g, out, offset = geometry, [], 0
    for _, group in _groups(sections):
        first = group[0]
        n = len(group) * g.section_bytes(first) // buffer.itemsize
        shape = (len(group), first.layer_count, g.block_size, first.head_count, 2, -1)
        out.append((group, buffer[offset : offset + n].reshape(shape)))
        offset += n
    return out


def pack_block(
    geometry: Geometry,
    part: RankPart,
    layers: Sequence[Buffer | torch.Tensor],
    order: str,
    sections: Sequence[Section],
    out: Buffer | None = None,
) -> Buffer:
    """The payloads of ``sections`` (all inside ``part``; e.g. its write plan) back to back, in ``out`` (a
    writable buffer of their size, e.g. a reused staging buffer) or a new bytearray: one strided copy per
    layer, whatever the number of sections."""
    g = geometry
    size = sum(g.section_bytes(s) for s in sections)
    out = bytearray(size) if out is None else out
    if memoryview(out).nbytes != size:
        raise ValueError(f"out of {memoryview(out).nbytes} B, the sections need {size} B")
    word = word_of(g)
    for group, region in _regions(g, sections, as_words(out, word, writable=True)):
        first, ng, hs = group[0], len(group), group[0].head_count
        g0 = (first.head_start - part.head_start) // hs  # write_plan: whole sections of the rank's heads
        for i in range(first.layer_count):
            layer = as_words(layers[first.layer_start - part.layer_start + i], word)
            src = nhkw(layer, order, part.head_count, g.block_size, hs)[:, g0 : g0 + ng]
            np.copyto(region[:, i], src.transpose(1, 0, 2, 3, 4))
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
    word = word_of(g)
    for group, region in _regions(g, sections, as_words(payloads, word)):
        first, last = group[0], group[-1]
        c0, c1 = first.head_start, last.head_start + last.head_count  # heads the group covers
        h0, h1 = max(c0, part.head_start), min(c1, part.head_start + part.head_count)
        l0 = max(first.layer_start, part.layer_start)
        l1 = min(first.layer_start + first.layer_count, part.layer_start + part.layer_count)
        for layer in range(l0, l1):
            src = region[:, layer - first.layer_start].transpose(1, 0, 2, 3, 4)  # [N, sections, heads, 2, W]
            dst = as_words(layers[layer - part.layer_start], word, True)
            hs, off = first.head_count, c0 - part.head_start
            if (h0, h1) == (c0, c1) and part.head_count % hs == 0 and off % hs == 0:  # whole sections: one copy
                whole = nhkw(dst, order, part.head_count, g.block_size, hs)
                np.copyto(whole[:, off // hs : off // hs + len(group)], src)
            else:  # a section wider than the rank's heads (a coarser grid): its heads, through a copy
                dst = nhkw(dst, order, part.head_count, g.block_size)[:, h0 - part.head_start : h1 - part.head_start]
                np.copyto(dst[:, :, 0], src.reshape(g.block_size, -1, *src.shape[3:])[:, h0 - c0 : h1 - c0])


__all__ = ["ORDERS", "as_words", "direct_runs", "layer_bytes", "nhkw", "pack_block", "unpack_block", "word_of"]
