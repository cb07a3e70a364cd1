"""vLLM's KV cache layouts as kvdi addresses them (kvdi.integrations.vllm.views), without vLLM.

The tensors here are built with the strides vLLM 0.32's ``create_kv_cache_views`` gives each
layout; tests/real_vllm/test_vllm_layouts.py builds them with vLLM's own code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorRole,
    WorkerConnector,
)
from kvdi.errors import ConfigError
from kvdi.integrations.vllm.bridge import LayoutBridge
from kvdi.integrations.vllm.layout import kv_cache_spec, kvdi_layer_view
from kvdi.integrations.vllm.views import block_rows, block_view, page_view, stored_order
from kvdi.layout import KVCacheSpec
from kvdi.settings import load_settings

SPEC = KVCacheSpec("m", 2, 2, 32, 16, "float16", block_order="nhc")
NB = 8
PAGE = 2 * 16 * 64 * 2  # heads x tokens x (K|V) x bytes


def _lbnhc(raw: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """Layer ``layer`` of an LBNHC cache as vLLM views it: ``[B, H, N, C]``, strides of ``[B, N, H, C]``."""
    return torch.as_strided(raw, (NB, 2, 16, 64), (PAGE // 2, 64, 128, 1), layer * NB * PAGE // 2)


def test_the_gpu_default_layout_from_the_issue_is_viewed_without_a_copy() -> None:
    """vLLM's default on a GPU (LBNHC): block-compact, not contiguous as [B, H, N, C]; kvdi's view is contiguous."""
    raw = torch.randn(2 * NB * PAGE // 2, dtype=torch.float16)
    cache = _lbnhc(raw)
    assert cache.stride() == (2048, 64, 128, 1) and not cache.is_contiguous()
    view = kvdi_layer_view(cache, SPEC, NB)
    assert view.is_contiguous() and view.data_ptr() == cache.data_ptr()
    assert view[3].numel() * view.element_size() == SPEC.layer_block_bytes
    assert torch.equal(view[3].reshape(16, 2, 64), cache[3].permute(1, 0, 2))  # [N, H, C]


def test_kernel_blocks_are_grouped_into_manager_blocks() -> None:
    """Kernel blocks of 8 tokens (B counts 2 per manager block): the view is by manager block, tokens in order."""
    cache = torch.randn(2 * NB, 2, 8, 64, dtype=torch.float16)  # LBHNC, kernel block 8
    view = block_view(cache, replace(SPEC, block_order="hnc"))
    assert view.shape[0] == NB and not view.is_contiguous()  # hnc across two kernel blocks: bridged
    assert torch.equal(view[1].reshape(2, 16, 64), torch.cat([cache[2], cache[3]], dim=1))


def test_a_view_of_another_dtype_or_shape_is_refused_in_one_line() -> None:
    """The message names shape, strides, dtype and order, and what is supported."""
    with pytest.raises(ConfigError) as err:
        block_view(torch.zeros(NB, 2, 16, 64), SPEC)  # float32 cache, float16 layout
    message = str(err.value)
    assert "\n" not in message and "float32" in message and "'nhc'" in message and "LBNHC" in message
    with pytest.raises(ConfigError, match="kernel blocks"):
        block_view(torch.zeros(NB, 2, 5, 64, dtype=torch.float16), SPEC)


def test_stored_order_follows_the_resolved_layout_and_refuses_unknown_names() -> None:
    """H before N in the layout: ``hnc``; N before H: ``nhc``; vLLM's legacy names alias; none resolved: kvdi's."""
    assert [stored_order(n) for n in ("LBNHC", "BLNHC", "NHD")] == ["nhc"] * 3
    assert [stored_order(n) for n in ("LBHNC", "BLHNC", "BHLNC", "LHBNC", "HND")] == ["hnc"] * 5
    assert stored_order(None) == ""
    with pytest.raises(ConfigError, match="'XYZ'.*LBNHC"):
        stored_order("XYZ")


def test_the_block_order_is_part_of_the_layout_fingerprint() -> None:
    """Two engines whose blocks are ordered differently never share keys or frames."""
    prints = {replace(SPEC, block_order=o).fingerprint() for o in ("", "nhc", "hnc")}
    assert len(prints) == 3
    assert KVCacheSpec("m", 2, 2, 32, 16, "float16").fingerprint() == replace(SPEC, block_order="").fingerprint()


def test_kv_cache_spec_takes_the_order_of_the_resolved_layout() -> None:
    """The scheduler and every worker read the layout vLLM resolved before building the connector."""
    model = SimpleNamespace(
        model="tiny",
        dtype=torch.float16,
        get_num_layers=lambda parallel: 2,
        get_num_kv_heads=lambda parallel: 2,
        get_head_size=lambda: 32,
    )
    config = SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", kv_cache_layout="LBNHC"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    assert kv_cache_spec(config).block_order == "nhc"
    config.cache_config.cache_dtype = "fp8_e4m3"
    with pytest.raises(ConfigError, match=r"'fp8_e4m3' \(KV cache layout LBNHC\).*kv_cache_dtype='auto'"):
        kv_cache_spec(config)


def _blnhc(raw: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer`` of a two-layer BLNHC cache: a block holds both layers' pages, one after the other."""
    return torch.as_strided(raw, (NB, 2, 16, 64), (PAGE, 64, 128, 1), layer * PAGE // 2)


def test_block_outermost_blocks_are_rows_every_layers_pages() -> None:
    """BLNHC: each block one run, two pages apart: byte rows over the same memory, block b at row 2b."""
    raw = torch.randn(NB * PAGE, dtype=torch.float16)
    views = {f"layers.{i}": kvdi_layer_view(_blnhc(raw, i), SPEC) for i in range(2)}
    assert not any(v.is_contiguous() for v in views.values())
    found = block_rows(views)
    assert found is not None
    rows, step = found
    assert step == 2 and all(r.is_contiguous() and r.dtype == torch.uint8 for r in rows.values())
    assert torch.equal(rows["layers.1"][2 * 5], views["layers.1"][5].contiguous().view(torch.uint8).reshape(-1))
    assert block_rows({"a": _lbnhc(raw).permute(1, 0, 2, 3)}) is None  # blocks not one run


class _RowWorker(WorkerConnector):
    """Loads: block ``i`` of every cache filled with ``i % 251 + 1``; fails the second block of each transfer."""

    def __init__(self) -> None:
        super().__init__(ConnectorContext("fake", KVConnectorRole.WORKER, load_settings(), SPEC))
        self.caches: Mapping[str, torch.Tensor] = {}
        self.seen: list[tuple[int, ...]] = []

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        assert all(t.is_contiguous() for t in kv_caches.values())
        self.caches = kv_caches

    def start_load_kv(self) -> None:
        assert isinstance(self.metadata, BlockTransferMetadata)
        for t in self.metadata.loads:
            self.seen.append(t.block_ids)
            for row in t.block_ids:
                for cache in self.caches.values():
                    cache[row] = row % 251 + 1
            self.report_load_error([t.block_ids[1]])

    def wait_for_save(self) -> None:
        pass


def test_bridge_addresses_block_outermost_caches_by_rows_and_reports_vllm_block_ids() -> None:
    """No scratch: the worker half sees rows ``2b``, writes land in vLLM's block ``b``, errors come back as ``b``."""
    raw = torch.zeros(NB * PAGE, dtype=torch.float16)
    views = {f"layers.{i}": kvdi_layer_view(_blnhc(raw, i), SPEC) for i in range(2)}
    worker = _RowWorker()
    bridge = LayoutBridge(views, worker)
    assert bridge.direct and bridge.row_step == 2 and bridge.scratch_bytes == 0
    meta = BlockTransferMetadata(loads=(BlockTransfer("r", (3, 6), (b"k3", b"k6")),))

    worker.bind_connector_metadata(bridge.bind(meta))
    bridge.load(worker.start_load_kv)

    assert worker.seen == [(6, 12)]
    assert torch.all(views["layers.1"][3].contiguous().view(torch.uint8) == 7)
    assert not views["layers.0"][2].any() and not views["layers.0"][4].any()  # neighbours untouched
    assert bridge.take_errors() == {6}


def test_state_pages_between_other_layers_pages_are_strided_rows() -> None:
    """A Mamba layer's pages a block stride apart (block-outermost): one ``[num_blocks, page]`` view, no copy."""
    raw = torch.arange(NB * 3 * 64, dtype=torch.int32).to(torch.int8)
    state = torch.as_strided(raw, (NB, 1, 1, 40), (3 * 64, 40, 40, 1), 64)
    pages: Any = page_view(state, 64)
    assert pages.shape == (NB, 64) and pages.stride() == (3 * 64, 1)
    assert torch.equal(pages[2, :40], state[2].reshape(-1).view(torch.uint8))
    with pytest.raises(ConfigError, match="pages of 512 bytes"):
        page_view(state, 512)
