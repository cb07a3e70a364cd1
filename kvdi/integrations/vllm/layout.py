"""vLLM's paged KV cache as kvdi sees it: the :class:`KVCacheSpec`, the block format tag, per-layer views.

- :func:`kv_cache_spec` / :func:`layout_from_vllm`: kvdi's layout of vLLM's model and cache config;
- :func:`rank_slice`: this process's place in vLLM's tensor/pipeline-parallel shape;
- :func:`block_format_tag`: how a stored block's bytes are ordered on vLLM's CPU backend;
- :func:`kvdi_layer_view` / :func:`ordered_layers`: vLLM's per-layer tensors addressed by block id.

Only :func:`block_format_tag` reads vLLM (its platform), and imports it when called.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from kvdi.errors import ConfigError
from kvdi.integrations.vllm.config import model_identity
from kvdi.integrations.vllm.parallel import RankSlice
from kvdi.layout import KVCacheSpec

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def kv_cache_spec(vllm_config: Any, tag: str = "") -> KVCacheSpec:
    """kvdi's KVCacheSpec of vLLM's paged cache: layers, KV heads, head dim, block size, dtype, model id.

    ``vllm_config`` is vLLM's ``VllmConfig``; ``tag`` is appended to the model id (the block
    format, the parallel shape and rank: see :func:`layout_from_vllm`). Layers and KV heads
    are this rank's under tensor or pipeline parallelism. Raises ConfigError for what kvdi's
    stored format cannot describe (quantized KV cache dtypes, other model dtypes).
    """
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if cache.cache_dtype not in ("auto", None):
        raise ConfigError(
            f"KvdiConnector needs kv_cache_dtype='auto', got {cache.cache_dtype!r}; set --kv-cache-dtype auto"
        )
    dtype = _DTYPES.get(model.dtype) if isinstance(model.dtype, torch.dtype) else None
    if dtype is None:
        raise ConfigError(f"KvdiConnector stores float32, float16 or bfloat16 KV; the model runs in {model.dtype}")
    return KVCacheSpec(
        model_id=f"{model_identity(vllm_config)}{tag}",
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()),
        block_size=int(cache.block_size),
        dtype=dtype,
    )


def rank_slice(vllm_config: Any, worker: bool) -> RankSlice:
    """This process's :class:`RankSlice`: the parallel shape, and for a worker its TP and PP rank.

    A worker's rank comes from ``parallel_config.rank`` (vLLM sets it per worker:
    ``pp_rank * tensor_parallel_size + tp_rank``); the scheduler is rank 0 of the shape.
    """
    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    rank = int(getattr(parallel, "rank", 0) or 0) if worker else 0
    return RankSlice(tp_size=tp, pp_size=pp, tp_rank=rank % tp, pp_rank=rank // tp)


def layout_from_vllm(vllm_config: Any, shape: RankSlice, worker: bool) -> KVCacheSpec:
    """kvdi's KVCacheSpec of vLLM's paged cache, its model id tagged with the block format and parallel shape.

    The scheduler's layout (which block keys derive from) names the shape, so engines of
    different shapes never share keys; a worker's layout (which its frames carry) also
    names its rank, so one rank's slice never passes as another's. Needs vLLM.
    """
    tag = block_format_tag(vllm_config) + shape.layout_tag() + (shape.rank_tag() if worker else "")
    return kv_cache_spec(vllm_config, tag)


def block_format_tag(vllm_config: Any) -> str:
    """Suffix of the layout's model id naming how a stored block's bytes are ordered.

    On vLLM's CPU backend kvdi stores each block verbatim (zero-copy), and the order of
    bytes inside a block depends on the CPU attention ISA (for ``vec`` the K tile is
    ``[head_dim, block_size]``, the V tile ``[block_size, head_dim]``). The ISA goes into
    the fingerprint so blocks are only ever loaded by engines that pack them the same way.
    Elsewhere blocks are stored in kvdi's order and the tag is empty.
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

    - vLLM's CPU backend ``[blocks, heads, block_size, 2 * head_dim]``: returned as is. Each
      block is contiguous and exactly ``layout.layer_block_bytes``, stored verbatim in the
      attention ISA's packing (see :func:`block_format_tag`).
    - ``[blocks, 2, block_size, heads, head_dim]`` (kvdi's order, FlashInfer NHD): as is.
    - ``[2, blocks, block_size, heads, head_dim]`` (FlashAttention NHD): a permuted, non-contiguous
      view in kvdi's order; :class:`LayoutBridge` copies such blocks through a scratch cache.

    Raises ConfigError naming the shape for anything else.
    """
    bs, heads, dim = layout.block_size, layout.num_kv_heads, layout.head_dim
    shape = tuple(cache.shape)
    if cache.dim() == 4 and shape[1:] == (heads, bs, 2 * dim) and cache.is_contiguous():
        return cache
    if cache.dim() == 5 and shape[2:] == (bs, heads, dim):
        if shape[1] == 2 and (num_blocks is None or shape[0] == num_blocks):
            return cache
        if shape[0] == 2:
            return cache.permute(1, 0, 2, 3, 4)
    raise ConfigError(
        f"KvdiConnector does not understand a paged KV tensor of shape {shape} (strides {tuple(cache.stride())}) "
        f"for block_size={bs}, kv_heads={heads}, head_dim={dim}; supported: vLLM's CPU backend and NHD layouts"
    )


def mamba_pages(state: Any, page_bytes: int) -> torch.Tensor:
    """A Mamba layer's state tensors (vLLM: views into one raw page per block) as ``[num_blocks, page_bytes]`` bytes.

    Raises ConfigError when the states do not lie in pages of ``page_bytes`` each.
    """
    import torch

    tensors = list(state) if isinstance(state, list | tuple) else [state]
    first = tensors[0]
    num_blocks = int(first.shape[0])
    storage = first.untyped_storage()
    base = min(t.storage_offset() * t.element_size() for t in tensors)
    if (
        any(t.stride(0) * t.element_size() != page_bytes for t in tensors)
        or storage.nbytes() < base + num_blocks * page_bytes
    ):
        raise ConfigError(
            f"KvdiConnector does not understand Mamba state of shapes {[tuple(t.shape) for t in tensors]} "
            f"(strides {[tuple(t.stride()) for t in tensors]}) as pages of {page_bytes} bytes"
        )
    raw = torch.empty(0, dtype=torch.uint8, device=first.device)
    raw.set_(storage, base, (num_blocks, page_bytes), (page_bytes, 1))
    return raw


def ordered_layers(names: Sequence[str]) -> list[str]:
    """vLLM's attention layer names in forward order (by the layer numbers in the names)."""

    def numbers(name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"(?<![A-Za-z_])\d+", name))

    return sorted(names, key=lambda n: (numbers(n), n))
