"""vLLM 0.32's own KV cache allocation driven through kvdi's vLLM adapter, for tests/real_vllm/test_vllm_layouts.py.

Nothing here starts an engine. An :class:`Engine` is one worker-role ``KvdiConnector`` over
the caches vLLM's worker would hand it: ``get_kv_cache_config_from_groups`` packs the
groups (padding, block-outermost interleaving, group overlay) and ``allocate_kv_cache``
builds the per-layer ``[B, H, N, C]`` views with ``create_kv_cache_views`` under a
``KVCacheLayout`` and kernel block size, exactly as vLLM's model runner does. Blocks move
through kvdi's real ``shared_storage`` store halves in a tmp dir.

:func:`logical_block` reads one block back in vLLM's own logical terms (per layer, K and V
apart), so comparisons never depend on kvdi's view of the layout.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvdi.connectors.base import BlockTransfer
from kvdi.connectors.store.keys import block_keys
from kvdi.connectors.store.scheduler import StoreTransferMetadata
from kvdi.integrations.vllm import KvdiConnector
from kvdi.integrations.vllm.envelopes import KvdiConnectorMetadata
from kvdi.integrations.vllm.groups import group_layout, groups_from_vllm
from kvdi.integrations.vllm.hybrid import HybridMetadata
from kvdi.integrations.vllm.layout import layout_from_vllm, rank_slice
from tests.real_vllm.vllm_support import kv_config

BLOCK = 32  # tokens per manager block (vLLM's cache_config.block_size)
HEAD_DIM = 32  # the tiny Llama's head_dim; 2 KV heads
NUM_BLOCKS = 12
PROMPT = list(range(7, 7 + 3 * BLOCK))  # three full blocks
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
MAMBA = "model.layers.2.linear_attn"
LAYOUTS = [m.name for m in KVCacheLayout]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_CONFIGS: dict[tuple[str, int], VllmConfig] = {}
_ENGINE_IDS = itertools.count()


def vllm_config(model: Path, dtype: str, tp: int) -> VllmConfig:
    """One real VllmConfig per (dtype, tp) for the tiny Llama (built once: the first costs seconds)."""
    key = (dtype, tp)
    if key not in _CONFIGS:
        _CONFIGS[key] = VllmConfig(
            model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype=dtype, max_model_len=512),
            cache_config=CacheConfig(block_size=BLOCK),
            parallel_config=ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="mp"),
            kv_transfer_config=KVTransferConfig(**kv_config("shared_storage")),
        )
    return _CONFIGS[key]


def groups(kind: str, dtype: torch.dtype, heads: int) -> list[KVCacheGroupSpec]:
    """vLLM's KV cache groups: ``one`` (full attention), ``sliding`` (+ full) or ``mamba`` (+ full, padded pages)."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=dtype)
    if kind == "one":
        return [KVCacheGroupSpec(list(LAYERS), full)]
    if kind == "sliding":
        window = SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=dtype, sliding_window=2 * BLOCK
        )
        return [KVCacheGroupSpec([LAYERS[0]], full), KVCacheGroupSpec([LAYERS[1]], window)]
    assert kind == "mamba"
    state = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 40), (5, 8)),  # conv and ssm state, smaller than an attention page: vLLM pads the page
        dtypes=(dtype, dtype),
        page_size_padded=full.page_size_bytes,
        mamba_cache_mode="align",
    )
    return [KVCacheGroupSpec(list(LAYERS), full), KVCacheGroupSpec([MAMBA], state)]


class Engine:
    """One worker-role KvdiConnector (its own engine id) over caches vLLM allocated under ``layout``."""

    def __init__(
        self,
        config: VllmConfig,
        store: Path,
        name: str,
        layout: str,
        kind: str = "one",
        kernel: int | None = None,
        rank: int = 0,
        seed: int | None = None,
    ) -> None:
        heads = int(config.model_config.get_num_kv_heads(config.parallel_config))
        self.dtype = config.model_config.dtype
        # What vLLM's engine core resolved and every worker adopted, before any connector is built.
        config.cache_config.kv_cache_layout = layout
        config.cache_config.num_gpu_blocks_override = NUM_BLOCKS
        config.parallel_config.rank = rank
        transfer = config.kv_transfer_config
        assert transfer is not None
        transfer.engine_id = f"{name}-{next(_ENGINE_IDS)}-r{rank}"  # one kvdi container per engine
        transfer.kv_connector_extra_config.update(
            {
                "kvdi.shared_storage.path": str(store),
                "kvdi.transfer.async_save": False,
                "kvdi.transfer.async_load": "off",
            }
        )
        self.kv_config: KVCacheConfig = get_kv_cache_config_from_groups(config, groups(kind, self.dtype, heads), 1)
        self.kv_config.kv_cache_layout = layout
        self.connector = KvdiConnector(config, KVConnectorRole.WORKER, self.kv_config)
        scheduler_layout = layout_from_vllm(config, rank_slice(config, worker=False), worker=False)
        self.groups = groups_from_vllm(self.kv_config)
        self.keys = (
            [block_keys(PROMPT, group_layout(scheduler_layout, g)) for g in self.groups]
            if len(self.groups) > 1
            else [block_keys(PROMPT, scheduler_layout)]
        )
        sizes = [
            (kernel or BLOCK) if isinstance(g.kv_cache_spec, AttentionSpec) else BLOCK  # Mamba: never split
            for g in self.kv_config.kv_cache_groups
        ]
        self.caches = allocate_kv_cache(self.kv_config, torch.device("cpu"), KVCacheLayout[layout], sizes)
        if seed is not None:
            gen = torch.Generator().manual_seed(seed)
            for view in self.caches.values():  # groups overlay one buffer: read sources back after filling all
                if view.is_floating_point():
                    view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
                else:
                    view.copy_(torch.randint(-128, 128, view.shape, generator=gen, dtype=torch.int8))
        self.connector.register_kv_caches(self.caches)

    def step(
        self, saves: list[list[int]] | None = None, loads: list[list[int]] | None = None, keys: Any = None
    ) -> tuple[set[str], set[str], set[int]]:
        """One engine step saving (or loading) the prompt's blocks of group ``g`` at vLLM block ids ``[g]``,
        through the adapter's hooks in vLLM's order. Returns (finished receiving, failed requests, failed blocks)."""
        keys = keys or self.keys
        hybrid = len(self.kv_config.kv_cache_groups) > 1
        per_group = []
        for g in range(len(self.kv_config.kv_cache_groups)):
            save = (BlockTransfer("r", tuple(saves[g]), tuple(keys[g][: len(saves[g])])),) if saves else ()
            load = (BlockTransfer("r", tuple(loads[g]), tuple(keys[g][: len(loads[g])])),) if loads else ()
            # Several groups: every load is asynchronous (the hybrid scheduler's metadata); one group: in the step.
            per_group.append(
                StoreTransferMetadata((), save, load, False) if hybrid else StoreTransferMetadata(load, save)
            )
        inner = HybridMetadata(tuple(per_group)) if hybrid else per_group[0]
        return self._run(KvdiConnectorMetadata(inner, idle=not (saves or loads)))

    def _run(self, meta: KvdiConnectorMetadata) -> tuple[set[str], set[str], set[int]]:
        c = self.connector
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        c.wait_for_save()
        results = c.get_transfer_results(set())
        errors = c.get_block_ids_with_load_errors()
        c.clear_connector_metadata()
        return set(results.finished_recving or ()), set(results.failed_recving or ()), errors

    def load(self, ids: list[list[int]], keys: Any = None) -> tuple[set[int], set[str]]:
        """Load the prompt's blocks into ``ids`` (per group) and step until the request finished receiving (several
        groups load in the background). Returns (failed vLLM block ids, failed requests)."""
        finished, failed, errors = self.step(loads=ids, keys=keys)
        deadline = time.monotonic() + 60  # a bound against a hang, not a timing assertion
        while len(self.kv_config.kv_cache_groups) > 1 and "r" not in finished and time.monotonic() < deadline:
            done, failed_now, more = self.step(saves=[[] for _ in self.kv_config.kv_cache_groups])
            finished, failed, errors = finished | done, failed | failed_now, errors | more
        assert len(self.kv_config.kv_cache_groups) == 1 or "r" in finished
        return errors, failed

    def close(self) -> None:
        self.connector.shutdown()


def logical_block(view: torch.Tensor, block: int) -> list[torch.Tensor]:
    """Manager block ``block`` of vLLM's ``[B, H, N, C]`` layer view as raw bytes: ``[K, V]`` of ``[H, N, D]``
    each (attention), or ``[page]`` (a state layer's ``int8`` view)."""
    if not view.is_floating_point():
        return [view[block].reshape(-1).clone()]
    blocks, heads, tokens, content = view.shape
    ratio = blocks // NUM_BLOCKS
    cells = view.view(NUM_BLOCKS, ratio, heads, tokens, content)[block].permute(1, 0, 2, 3).reshape(heads, -1, content)
    half = content // 2
    return [cells[..., :half].contiguous().view(torch.uint8), cells[..., half:].contiguous().view(torch.uint8)]
