"""vLLM's paged KV tensors as kvdi addresses them (kvdi.integrations.vllm.layout and .bridge), without vLLM.

The integration suite checks the CPU layout against vLLM's own attention kernel.
"""

from __future__ import annotations

from collections.abc import Mapping
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
from kvdi.integrations.vllm.layout import kv_cache_spec, kvdi_layer_view, ordered_layers, rank_slice
from kvdi.integrations.vllm.parallel import RankSlice
from kvdi.layout import KVCacheSpec
from kvdi.settings import load_settings

SPEC = KVCacheSpec("m", 2, 2, 32, 32, "float32")


def _vllm_config(tp: int = 1, cache_dtype: str = "auto", dtype: torch.dtype = torch.float16) -> Any:
    model = SimpleNamespace(
        model="tiny",
        dtype=dtype,
        get_num_layers=lambda parallel: 3,
        get_num_kv_heads=lambda parallel: 4,
        get_head_size=lambda: 64,
    )
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(block_size=16, cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
    )


def test_layout_follows_the_model_and_cache_config_with_the_format_tag() -> None:
    spec = kv_cache_spec(_vllm_config(), "@tag")
    assert spec == KVCacheSpec("tiny@tag", 3, 4, 64, 16, "float16")


@pytest.mark.parametrize(
    ("config", "needle"),
    [(_vllm_config(cache_dtype="fp8"), "kv_cache_dtype"), (_vllm_config(dtype=torch.int8), "float32")],
)
def test_layouts_kvdi_cannot_store_are_config_errors(config: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        kv_cache_spec(config)


def test_cpu_layout_is_used_as_is() -> None:
    cache = torch.zeros(6, SPEC.num_kv_heads, SPEC.block_size, 2 * SPEC.head_dim)
    view = kvdi_layer_view(cache, SPEC)
    assert view.data_ptr() == cache.data_ptr() and view[1].numel() * view.element_size() == SPEC.layer_block_bytes


def test_flash_attention_layout_is_viewed_in_kvdi_order() -> None:
    cache = torch.randn(2, 5, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    view = kvdi_layer_view(cache, SPEC, num_blocks=5)
    assert view.shape == (5, 2, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    assert torch.equal(view[3, 1], cache[1, 3])


def test_unknown_cache_shape_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"\(7, 3\)"):
        kvdi_layer_view(torch.zeros(7, 3), SPEC)


def test_layers_are_ordered_by_number_not_text() -> None:
    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.0.self_attn.attn"]
    assert ordered_layers(names) == [names[2], names[1], names[0]]


class _CopyingWorker(WorkerConnector):
    """Loads: fills block ``i`` with ``i + 1``, fails slot 1. Saves: remembers the bytes it was asked to save."""

    def __init__(self) -> None:
        super().__init__(ConnectorContext("fake", KVConnectorRole.WORKER, load_settings(), SPEC))
        self.caches: Mapping[str, torch.Tensor] = {}
        self.saved: dict[bytes, torch.Tensor] = {}

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        assert all(t.is_contiguous() for t in kv_caches.values())
        self.caches = kv_caches

    def start_load_kv(self) -> None:
        assert isinstance(self.metadata, BlockTransferMetadata)
        for t in self.metadata.loads:
            for slot in t.block_ids:
                for cache in self.caches.values():
                    cache[slot] = float(slot + 1)
            self.report_load_error([t.block_ids[1]])

    def wait_for_save(self) -> None:
        assert isinstance(self.metadata, BlockTransferMetadata)
        for t in self.metadata.saves:
            for slot, key in zip(t.block_ids, t.block_keys, strict=True):
                self.saved[key] = self.caches["layers.0"][slot].clone()


def test_bridge_copies_non_contiguous_blocks_through_scratch() -> None:
    vllm_cache = {f"layers.{i}": torch.zeros(2, 6, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim) for i in range(2)}
    views = {name: kvdi_layer_view(t, SPEC, num_blocks=6) for name, t in vllm_cache.items()}
    worker = _CopyingWorker()
    bridge = LayoutBridge(views, worker)
    assert not bridge.direct
    views["layers.0"][5] = 7.0
    meta = BlockTransferMetadata(
        loads=(BlockTransfer("r", (3, 4), (b"k3", b"k4")),), saves=(BlockTransfer("s", (5,), (b"k5",)),)
    )

    worker.bind_connector_metadata(bridge.bind(meta))
    bridge.load(worker.start_load_kv)
    bridge.save(worker.wait_for_save)

    assert torch.all(views["layers.1"][3] == 1.0)  # slot 0 -> vLLM block 3
    assert torch.all(views["layers.1"][4] == 0.0)  # slot 1 failed: not copied
    assert bridge.take_errors() == {4} and bridge.take_errors() == set()
    assert torch.all(worker.saved[b"k5"] == 7.0)


def test_bridge_runs_async_store_transfers_in_the_step_and_still_reports_them(tmp_path: Any) -> None:
    """Through scratch, async loads and saves of the store halves run in the step (scratch is reused next
    step) and the requests still reach vLLM: finished receiving, then finished sending when they end."""
    from kvdi.connectors.shared_storage import FileBlockStore
    from kvdi.connectors.store import StoreWorkerConnector
    from kvdi.connectors.store.scheduler import StoreTransferMetadata

    settings = load_settings(kv_role="kv_both", engine_id="bridge")
    assert settings.transfer.async_save
    worker = StoreWorkerConnector(
        ConnectorContext("shared_storage", KVConnectorRole.WORKER, settings, SPEC, None, FileBlockStore(tmp_path))
    )
    gen = torch.Generator().manual_seed(0)
    vllm_cache = {f"layers.{i}": torch.rand(2, 6, SPEC.block_size, 2, 32, generator=gen) for i in range(2)}
    views = {name: kvdi_layer_view(t, SPEC, num_blocks=6) for name, t in vllm_cache.items()}
    bridge = LayoutBridge(views, worker)
    assert not bridge.direct
    originals = {name: v[[1, 2]].clone() for name, v in views.items()}

    def step(meta: StoreTransferMetadata, finished: set[str]) -> tuple[set[str] | None, set[str] | None]:
        worker.bind_connector_metadata(bridge.bind(meta))
        bridge.load(worker.start_load_kv)
        bridge.save(worker.wait_for_save)
        done = worker.get_finished(finished)
        worker.clear_connector_metadata()
        return done

    saves = (BlockTransfer("w", (1, 2), (b"k1", b"k2")),)
    assert step(StoreTransferMetadata((), saves, (), async_save=True), {"w"}) == ({"w"}, None)
    for v in views.values():
        v[[1, 2]] = 0.0
    async_load = StoreTransferMetadata((), (), (BlockTransfer("r", (4, 5), (b"k1", b"k2")),), async_save=True)

    first = step(async_load, set())
    assert all(torch.equal(views[n][[4, 5]], originals[n]) for n in views)  # loaded within the step
    second = step(StoreTransferMetadata((), (), ()), set())
    # Reported (vLLM resumes "r") in the step its marker job finished in: this one or the next.
    assert first[0] is None and second[0] is None and (first[1] or set()) | (second[1] or set()) == {"r"}
    assert step(StoreTransferMetadata((), (), ()), {"r"}) == ({"r"}, None)  # held until it ends, then freed
    assert bridge.take_errors() == set()
    worker.shutdown()


class _RoundWorker(WorkerConnector):
    """Loads: fills each slot with its key's number, fails the key ``b"bad"``; saves: keeps each key's bytes.
    Records every round it was bound for (loads, saves, markers) and the largest slot it was handed."""

    def __init__(self, settings: Any) -> None:
        super().__init__(ConnectorContext("fake", KVConnectorRole.WORKER, settings, SPEC))
        self.caches: Mapping[str, torch.Tensor] = {}
        self.saved: dict[bytes, torch.Tensor] = {}
        self.rounds: list[tuple[list[bytes], list[bytes], list[str]]] = []

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.caches = kv_caches

    def start_load_kv(self) -> None:
        meta = self.metadata
        assert isinstance(meta, BlockTransferMetadata)
        markers = [t.request_id for t in getattr(meta, "async_loads", ())]
        self.rounds.append(([k for t in meta.loads for k in t.block_keys], [], markers))
        for t in meta.loads:
            for slot, key in zip(t.block_ids, t.block_keys, strict=True):
                if key == b"bad":
                    self.report_load_error([slot])
                    continue
                for cache in self.caches.values():
                    cache[slot] = float(key[1:])

    def wait_for_save(self) -> None:
        meta = self.metadata
        assert isinstance(meta, BlockTransferMetadata)
        self.rounds.append(([], [k for t in meta.saves for k in t.block_keys], []))
        for t in meta.saves:
            for slot, key in zip(t.block_ids, t.block_keys, strict=True):
                self.saved[key] = self.caches["layers.0"][slot].clone()


def test_bridge_scratch_stays_within_max_staging_bytes_by_moving_a_step_in_rounds() -> None:
    """A step larger than the scratch bound moves in rounds of at most that many blocks: every block lands in
    its own vLLM block, a request whose load failed loads no more of its blocks, the async loads' markers
    reach the worker once (the last load round), and the scratch never holds more than the bound."""
    from kvdi.connectors.store.scheduler import StoreTransferMetadata

    settings = load_settings(allocator={"max_staging_bytes": 3 * SPEC.block_bytes})  # 3 blocks of both layers
    vllm_cache = {
        f"layers.{i}": torch.zeros(2, 12, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim) for i in range(2)
    }
    views = {name: kvdi_layer_view(t, SPEC, num_blocks=12) for name, t in vllm_cache.items()}
    worker = _RoundWorker(settings)
    bridge = LayoutBridge(views, worker)
    assert not bridge.direct and bridge.max_slots == 3
    for b in range(8, 12):
        views["layers.0"][b] = float(100 + b)
    meta = StoreTransferMetadata(
        loads=(BlockTransfer("a", (0, 1), (b"k1", b"k2")),),
        saves=(BlockTransfer("w", (8, 9, 10, 11), (b"s8", b"s9", b"s10", b"s11")),),
        async_loads=(
            BlockTransfer("b", (2, 3, 4, 5, 6), (b"k3", b"k4", b"bad", b"k6", b"k7")),
            BlockTransfer("c", (7,), (b"k8",)),
        ),
    )
    bookkeeping = bridge.bind(meta)
    assert isinstance(bookkeeping, StoreTransferMetadata) and not bookkeeping.loads and not bookkeeping.saves
    worker.bind_connector_metadata(bookkeeping)
    bridge.load(worker.start_load_kv)
    bridge.save(worker.wait_for_save)

    assert worker.rounds == [
        ([b"k1", b"k2", b"k3"], [], []),
        ([b"k4", b"bad", b"k6"], [], []),  # "b" failed here: its k7 is not loaded in the next round
        ([b"k8"], [], ["b", "c"]),
        ([], [b"s8", b"s9", b"s10"], []),
        ([], [b"s11"], []),
    ]
    assert [float(views["layers.1"][b].flatten()[0]) for b in range(8)] == [1, 2, 3, 4, 0, 6, 0, 8]
    assert bridge.take_errors() == {4}
    assert {k: float(v.flatten()[0]) for k, v in worker.saved.items()} == {
        b"s8": 108, b"s9": 109, b"s10": 110, b"s11": 111,
    }  # fmt: skip
    assert bridge.scratch_bytes <= settings.allocator.max_staging_bytes
    assert max(t.shape[0] for t in bridge.scratch.values()) == 3


def test_a_real_store_half_round_trips_a_step_larger_than_the_bridge_scratch(tmp_path: Any) -> None:
    """The store worker half, rebound for each round: 6 blocks with a 2-block bound, saved and loaded byte for byte."""
    from kvdi.connectors.shared_storage import FileBlockStore
    from kvdi.connectors.store import StoreWorkerConnector

    settings = load_settings(kv_role="kv_both", allocator={"max_staging_bytes": 2 * SPEC.block_bytes})
    context = ConnectorContext("shared_storage", KVConnectorRole.WORKER, settings, SPEC, None, FileBlockStore(tmp_path))
    worker = StoreWorkerConnector(context)
    vllm_cache = {n: torch.zeros(2, 16, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim) for n in SPEC.layer_names}
    views = {name: kvdi_layer_view(t, SPEC, num_blocks=16) for name, t in vllm_cache.items()}
    bridge = LayoutBridge(views, worker)
    assert bridge.max_slots == 2
    keys = tuple(f"k{b}".encode() for b in range(6))
    for t in vllm_cache.values():
        for b in range(6):
            t[:, b] = float(10 + b)
    worker.bind_connector_metadata(bridge.bind(BlockTransferMetadata((), (BlockTransfer("w", tuple(range(6)), keys),))))
    bridge.save(worker.wait_for_save)
    loads = (BlockTransfer("r", tuple(range(8, 14)), keys),)
    worker.bind_connector_metadata(bridge.bind(BlockTransferMetadata(loads)))
    bridge.load(worker.start_load_kv)
    assert bridge.take_errors() == set() and worker.stats.loaded_blocks == 6
    for t in vllm_cache.values():
        assert [set(t[:, 8 + b].unique().tolist()) for b in range(6)] == [{10.0 + b} for b in range(6)]
    assert bridge.scratch_bytes <= 2 * SPEC.block_bytes
    worker.shutdown()


def test_rank_slice_of_a_worker_follows_vllm_rank_and_the_scheduler_is_rank_zero() -> None:
    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=2, rank=3))
    assert rank_slice(config, worker=True) == RankSlice(tp_size=2, pp_size=2, tp_rank=1, pp_rank=1)
    assert rank_slice(config, worker=False) == RankSlice(tp_size=2, pp_size=2)


def test_layout_tag_names_the_parallel_shape_for_keys_and_the_rank_for_frames() -> None:
    config = _vllm_config(tp=2)
    shape = RankSlice(tp_size=2, tp_rank=1)
    scheduler = kv_cache_spec(config, shape.layout_tag())
    worker = kv_cache_spec(config, shape.layout_tag() + shape.rank_tag())
    single = kv_cache_spec(_vllm_config())
    assert scheduler.model_id == "tiny@tp2pp1" and worker.model_id == "tiny@tp2pp1.rank1-0"
    assert len({scheduler.fingerprint, worker.fingerprint, single.fingerprint}) == 3
