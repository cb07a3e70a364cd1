"""vLLM's KV cache layouts and the byte order kvdi stores a block in (vLLM-free).

vLLM 0.32 resolves one ``KVCacheLayout`` per engine (``vllm/v1/kv_cache_layout.py``): a
permutation of the logical axes ``[L, B, H, N, C]`` (layer, block, KV head, token, content;
C is a head's K then V, ``head_size + head_size_v`` elements). Each layer's cache reaches
``register_kv_caches`` as the 4-D ``[B, H, N, C]`` view of ``create_kv_cache_views``, whatever
the layout: only its strides differ, and B counts kernel blocks when the attention kernel
splits a manager block into ``ratio`` kernel blocks of ``N`` tokens. Older vLLM releases handed
5-D ``[blocks, 2, N, H, D]`` or ``[2, blocks, N, H, D]`` tensors.

kvdi stores a block in one of three byte orders (:data:`ORDERS`), named by the layout's
``block_order`` (part of its fingerprint, so two orders never share a key or a frame):

- ``"nhc"``: ``[N, H, C]`` per block: the order of ``LBNHC`` and ``BLNHC`` (vLLM's default on a GPU);
- ``"hnc"``: ``[H, N, C]`` per block: the order of ``LBHNC``, ``BLHNC``, ``BHLNC``, ``LHBNC``
  (vLLM's CPU backend, FlashInfer on Blackwell);
- ``""``: kvdi's own ``[2, N, H, D]`` (K block then V block): the 5-D layouts of older vLLM.

:func:`block_view` views any vLLM layer cache as ``view[manager_block]`` in the layout's order,
without copying. Where the layout keeps each block in that order as one run of bytes the view is
contiguous and kvdi's store halves read and write vLLM's memory directly; where each block is one
run but runs lie a whole number of blocks apart (block-outermost packing) :func:`block_rows`
addresses them by bytes, still without a copy; otherwise (kernel blocks of an ``hnc`` layout,
padded pages, ``LHBNC``/``BHLNC``) the :class:`~kvdi.integrations.vllm.bridge.LayoutBridge`
moves blocks through bounded scratch in that order. Either way, the bytes stored for a block
depend only on ``block_order``, never on the layout's strides or the kernel block size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvdi.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvdi.layout import KVCacheSpec

LAYOUT_ORDERS = {
    "LBNHC": "nhc",
    "BLNHC": "nhc",
    "LBHNC": "hnc",
    "BLHNC": "hnc",
    "BHLNC": "hnc",
    "LHBNC": "hnc",
    "NHD": "nhc",  # vLLM's legacy aliases of LBNHC / LBHNC (VLLM_KV_CACHE_LAYOUT)
    "HND": "hnc",
}
"""The stored byte order of each ``KVCacheLayout`` name vLLM 0.32 can resolve."""

ORDERS = ("", "nhc", "hnc")
"""Stored block orders: kvdi's ``[2, N, H, D]``, ``[N, H, C]``, ``[H, N, C]``."""


def stored_order(layout_name: str | None) -> str:
    """The stored block order for vLLM's resolved KV cache layout; ``""`` (kvdi's) when none is resolved.

    Raises ConfigError naming the layout for a name vLLM 0.32 does not define.
    """
    if layout_name is None:
        return ""
    order = LAYOUT_ORDERS.get(str(layout_name).upper())
    if order is None:
        raise ConfigError(
            f"KvdiConnector does not know vLLM's KV cache layout {layout_name!r} "
            f"(VLLM_KV_CACHE_LAYOUT / cache_config.kv_cache_layout); supported: {', '.join(LAYOUT_ORDERS)}"
        )
    return order


def _refuse(cache: torch.Tensor, layout: KVCacheSpec, why: str) -> ConfigError:
    return ConfigError(
        f"KvdiConnector cannot address a paged KV tensor of shape {tuple(cache.shape)} "
        f"(strides {tuple(cache.stride())}, dtype {cache.dtype}) under block order {layout.block_order or 'kvdi'!r} "
        f"for block_size={layout.block_size}, kv_heads={layout.num_kv_heads}, head_dim={layout.head_dim}, "
        f"dtype={layout.dtype}: {why}; supported: vLLM's [B, H, N, 2*head_dim] views of every KVCacheLayout "
        "(LBNHC, LBHNC, BLNHC, BLHNC, BHLNC, LHBNC; kernel blocks dividing block_size) and the 5-D NHD layouts, "
        "in float32, float16 or bfloat16"
    )


def block_view(cache: torch.Tensor, layout: KVCacheSpec) -> torch.Tensor:
    """vLLM's 4-D ``[B, H, N, C]`` layer cache as ``view[manager_block]`` in ``layout.block_order`` (no copy).

    ``B`` may count kernel blocks of ``N`` tokens (``layout.block_size`` a multiple of ``N``);
    ``C`` is K then V, ``2 * head_dim`` elements of ``layout.dtype``. The view's block ``b``
    holds exactly ``layout.layer_block_bytes`` bytes; it is contiguous when vLLM's memory
    already holds every block in that order, one block after the other.

    Raises ConfigError (one line naming shape, strides, dtype, order and what is supported)
    for anything else.
    """
    heads, dim, block_size = layout.num_kv_heads, layout.head_dim, layout.block_size
    if cache.dim() != 4 or cache.shape[1] != heads or cache.shape[3] != 2 * dim:
        raise _refuse(cache, layout, "not a [B, H, N, 2*head_dim] view")
    if str(cache.dtype).removeprefix("torch.") != layout.dtype:
        raise _refuse(cache, layout, "its dtype is not the model's")
    tokens = int(cache.shape[2])
    if tokens == 0 or block_size % tokens or cache.shape[0] % (block_size // tokens):
        raise _refuse(cache, layout, "its kernel blocks do not divide the manager blocks")
    split = cache.view(-1, block_size // tokens, *cache.shape[1:])  # [B, ratio, H, n, C]: ratio * n == block_size
    if layout.block_order == "nhc":
        return split.permute(0, 1, 3, 2, 4)  # [B, ratio, n, H, C] == [B, N, H, C]
    if layout.block_order == "hnc":
        return split.permute(0, 2, 1, 3, 4)  # [B, H, ratio, n, C] == [B, H, N, C]
    if layout.block_order == "":
        return split.view(*split.shape[:-1], 2, dim).permute(
            0, 4, 1, 3, 2, 5
        )  # [B, 2, ratio, n, H, D] == [B, 2, N, H, D]
    raise _refuse(cache, layout, f"block order must be one of {ORDERS}")


def page_view(state: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...], page_bytes: int) -> torch.Tensor:
    """A state layer's tensors (vLLM: views into one page per block) as ``[num_blocks, page_bytes]`` bytes (no copy).

    A page is the ``page_bytes`` from the lowest start of the tensors' block 0, repeated at
    their common block stride: contiguous when pages sit one after another (layer-outermost
    layouts), strided when other layers' pages lie between them (block-outermost layouts).
    Raises ConfigError when the tensors do not lie in such pages.
    """
    import torch

    tensors = list(state) if isinstance(state, list | tuple) else [state]
    first = tensors[0]
    num_blocks = int(first.shape[0])
    storage = first.untyped_storage()
    base = min(t.storage_offset() * t.element_size() for t in tensors)
    strides = {t.stride(0) * t.element_size() for t in tensors}
    stride = strides.pop() if len(strides) == 1 else 0
    if stride < page_bytes or storage.nbytes() < base + (num_blocks - 1) * stride + page_bytes:
        raise ConfigError(
            f"KvdiConnector does not understand state of shapes {[tuple(t.shape) for t in tensors]} "
            f"(strides {[tuple(t.stride()) for t in tensors]}) as pages of {page_bytes} bytes "
            "(one block stride, at least a page apart)"
        )
    raw = torch.empty(0, dtype=torch.uint8, device=first.device)
    raw.set_(storage, base, (num_blocks, page_bytes), (stride, 1))
    return raw


def block_rows(views: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int] | None:
    """Views whose every block is one run of bytes, ``k`` blocks' bytes apart, as contiguous ``uint8`` rows (no copy).

    Block-outermost layouts (``BLNHC``, ``BLHNC``) put the other layers' pages of a block
    between one layer's blocks, so a layer view is not contiguous although each block is.
    When every view's block stride is the same whole number ``k`` of its block's bytes, view
    ``name`` becomes ``rows[name]``: ``[(num_blocks - 1) * k + 1, block_bytes]`` bytes over the
    same storage, vLLM's block ``b`` being row ``b * k``. Returns ``(rows, k)``, or None when
    some block is not one run or the strides differ (then blocks go through scratch).
    """
    import torch

    rows: dict[str, torch.Tensor] = {}
    strides = set()
    for name, view in views.items():
        block = view[0].numel() * view.element_size() if view.shape[0] else 0
        step = view.stride(0) * view.element_size()
        if not block or view.shape[0] < 2 or not view[0].is_contiguous() or step % block:
            return None
        strides.add(step // block)
        count = (int(view.shape[0]) - 1) * (step // block) + 1
        base = view.storage_offset() * view.element_size()
        storage = view.untyped_storage()
        if storage.nbytes() < base + count * block:
            return None
        raw = torch.empty(0, dtype=torch.uint8, device=view.device)
        raw.set_(storage, base, (count, block), (block, 1))
        rows[name] = raw
    if len(strides) != 1:
        return None
    return rows, strides.pop()


__all__ = ["LAYOUT_ORDERS", "ORDERS", "block_rows", "block_view", "page_view", "stored_order"]
