"""vLLM's paged KV cache as kvdi sees it: the :class:`KVCacheSpec`, the block format tag, per-layer views.

- :func:`kv_cache_spec` / :func:`layout_from_vllm`: kvdi's layout of vLLM's model and cache config;
- :func:`rank_slice`: this process's place in vLLM's tensor/pipeline-parallel shape;
- :func:`block_format_tag`: how a stored block's bytes are ordered on vLLM's CPU backend;
- :func:`kvdi_layer_view` / :func:`ordered_layers`: vLLM's per-layer tensors addressed by block id
  (the layouts themselves: :mod:`.views`).

Only :func:`block_format_tag` reads vLLM (its platform), and imports it when called.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from kvdi.errors import ConfigError
from kvdi.integrations.vllm.config import model_identity
from kvdi.integrations.vllm.parallel import RankSlice, canonical_share
from kvdi.integrations.vllm.views import block_view, stored_order
from kvdi.layout import KVCacheSpec

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def kv_cache_spec(vllm_config: Any, tag: str = "") -> KVCacheSpec:
    """kvdi's KVCacheSpec of vLLM's paged cache: layers, KV heads, head dim, block size, dtype, model id, block order.

    ``vllm_config`` is vLLM's ``VllmConfig``; ``tag`` is appended to the model id (the block
    format, the parallel shape and rank: see :func:`layout_from_vllm`). Layers and KV heads
    are this rank's under tensor or pipeline parallelism. The block order follows the KV
    cache layout vLLM resolved (``cache_config.kv_cache_layout``, set in every process before
    a connector is built; :func:`~kvdi.integrations.vllm.views.stored_order`). Raises
    ConfigError, in one line naming the layout and dtype, for what kvdi's stored format
    cannot describe (quantized KV cache dtypes, other model dtypes).
    """
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    layout_name = getattr(cache, "kv_cache_layout", None)
    order = stored_order(layout_name)
    supported = "supported: kv_cache_dtype='auto' with a float32, float16 or bfloat16 model, in every KV cache layout"
    if cache.cache_dtype not in ("auto", None):
        raise ConfigError(
            f"KvdiConnector cannot store kv_cache_dtype={cache.cache_dtype!r} (KV cache layout {layout_name}); "
            f"{supported}: set --kv-cache-dtype auto"
        )
    dtype = _DTYPES.get(model.dtype) if isinstance(model.dtype, torch.dtype) else None
    if dtype is None:
        raise ConfigError(
            f"KvdiConnector cannot store KV of a model running in {model.dtype} (KV cache layout {layout_name}); "
            f"{supported}"
        )
    return KVCacheSpec(
        model_id=f"{model_identity(vllm_config)}{tag}",
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()),
        block_size=int(cache.block_size),
        dtype=dtype,
        block_order=order,
    )


def rank_slice(vllm_config: Any, worker: bool) -> RankSlice:
    """This process's :class:`RankSlice`: the parallel shape, and for a worker its TP and PP rank.

    A worker's rank comes from ``parallel_config.rank`` (vLLM sets it per worker:
    ``pp_rank * tensor_parallel_size + tp_rank``); the scheduler is rank 0 of the shape.
    """
    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    rank = int(getattr(parallel, "rank", 0) or 0) if worker else 0
    return RankSlice(
        tp_size=tp, pp_size=pp, tp_rank=rank % tp, pp_rank=rank // tp, canonical=canonical_share(vllm_config)
    )


def layout_from_vllm(vllm_config: Any, shape: RankSlice, worker: bool) -> KVCacheSpec:
    """kvdi's KVCacheSpec of vLLM's paged cache, its model id tagged with the block format and parallel shape.

    The scheduler's layout (which block keys derive from) names the shape, so engines of
    different shapes never share keys; a worker's layout (which its frames carry) also
    names its rank, so one rank's slice never passes as another's. Needs vLLM.
    """
    tag = block_format_tag(vllm_config) + shape.layout_tag() + (shape.rank_tag() if worker else "")
    spec = kv_cache_spec(vllm_config, tag)
    if shape.canonical is not None and not worker:  # canonical: the scheduler names blocks of the whole model
        spec = replace(spec, num_layers=shape.canonical.num_layers, num_kv_heads=shape.canonical.num_kv_heads)
    return spec


def block_format_tag(vllm_config: Any) -> str:
    """Suffix of the layout's model id naming how a stored block's bytes are ordered.

    On vLLM's CPU backend kvdi stores each block verbatim (zero-copy), and the order of
    bytes inside a block depends on the CPU attention ISA (for ``vec`` the K tile is
    ``[head_dim, block_size]``, the V tile ``[block_size, head_dim]``). The ISA goes into
    the fingerprint so blocks are only ever loaded by engines that pack them the same way.
    Elsewhere the tag is empty: the layout's ``block_order`` (:func:`kv_cache_spec`) names
    the order of the stored bytes.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model = vllm_config.model_config
        isa = _get_attn_isa(model.dtype, vllm_config.cache_config.block_size, model.get_head_size())  # type: ignore[arg-type,unused-ignore]
    except Exception:  # private helper of vLLM; a coarser tag still never mixes CPU and kvdi order
        isa = "unknown"
    return f"@vllm-cpu-{isa}"


def kvdi_layer_view(cache: torch.Tensor, layout: KVCacheSpec, num_blocks: int | None = None) -> torch.Tensor:
    """One layer of vLLM's paged cache as kvdi's worker half addresses it: ``view[block_id]`` is that block.

    - vLLM 0.32's ``[B, H, N, C]`` view of any KV cache layout (kernel blocks, padded pages,
      block-outermost packing included): :func:`~kvdi.integrations.vllm.views.block_view` in
      the layout's ``block_order``, contiguous where vLLM's memory allows, else bridged.
    - With no block order (kvdi's) and vLLM's CPU backend ``[blocks, heads, block_size,
      2 * head_dim]`` contiguous: as is, stored verbatim in the attention ISA's packing (see
      :func:`block_format_tag`); another 4-D view is viewed in kvdi's order.
    - ``[blocks, 2, block_size, heads, head_dim]`` (kvdi's order, FlashInfer NHD): as is.
    - ``[2, blocks, block_size, heads, head_dim]`` (FlashAttention NHD): a permuted, non-contiguous
      view in kvdi's order; :class:`LayoutBridge` copies such blocks through a scratch cache.

    Raises ConfigError naming the shape for anything else.
    """
    bs, heads, dim = layout.block_size, layout.num_kv_heads, layout.head_dim
    shape = tuple(cache.shape)
    if cache.dim() == 4:
        if not layout.block_order and shape[1:] == (heads, bs, 2 * dim) and cache.is_contiguous():
            return cache
        return block_view(cache, layout)
    if cache.dim() == 5 and shape[2:] == (bs, heads, dim) and not layout.block_order:
        if shape[1] == 2 and (num_blocks is None or shape[0] == num_blocks):
            return cache
        if shape[0] == 2:
            return cache.permute(1, 0, 2, 3, 4)
    raise ConfigError(
        f"KvdiConnector does not understand a paged KV tensor of shape {shape} (strides {tuple(cache.stride())}) "
        f"for block_size={bs}, kv_heads={heads}, head_dim={dim}, block order {layout.block_order or 'kvdi'!r}; "
        "supported: vLLM's [B, H, N, 2*head_dim] views of every KV cache layout and the 5-D NHD layouts"
    )


def ordered_layers(names: Sequence[str]) -> list[str]:
    """vLLM's attention layer names in forward order (by the layer numbers in the names)."""

    def numbers(name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"(?<![A-Za-z_])\d+", name))

    return sorted(names, key=lambda n: (numbers(n), n))
