"""The vLLM adapter's translation pieces, without starting an engine (vLLM must be importable)."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_support import require_vllm

require_vllm()

import torch  # noqa: E402

from kvdi.connectors.base import (  # noqa: E402
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorRole,
    WorkerConnector,
)
from kvdi.errors import ConfigError  # noqa: E402
from kvdi.integrations import vllm as adapter  # noqa: E402
from kvdi.layout import KVCacheSpec  # noqa: E402
from kvdi.settings import load_settings  # noqa: E402

SPEC = KVCacheSpec("m", 2, 2, 32, 32, "float32")


def test_extra_config_keys_become_nested_settings() -> None:
    extra = {
        "kvdi.kv_connector": "redis",
        "kvdi.redis.url": "redis://h:1/0",
        "shared_storage_path": "/x",
        "kvdi": {"cpu_offload": {"max_bytes": 5}},
    }
    assert adapter.settings_overrides(extra) == {
        "kv_connector": "redis",
        "redis": {"url": "redis://h:1/0"},
        "cpu_offload": {"max_bytes": 5},
    }


def test_extra_config_value_and_section_clash_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"kvdi\.redis"):
        adapter.settings_overrides({"kvdi.redis": "x", "kvdi.redis.url": "redis://h"})


def test_vllm_role_engine_id_and_report_policy_win(monkeypatch: pytest.MonkeyPatch) -> None:
    transfer = SimpleNamespace(
        kv_connector_extra_config={"kvdi.kv_role": "kv_both", "kvdi.shared_storage.path": "/tmp/kvdi-x"},
        kv_role="kv_consumer",
        engine_id="e1",
    )
    config: Any = SimpleNamespace(kv_transfer_config=transfer)
    kwargs = adapter.kvdi_settings_kwargs(config)
    settings = load_settings(**kwargs)
    assert (settings.kv_role, settings.engine_id, settings.kv_load_failure_policy) == ("kv_consumer", "e1", "recompute")
    assert str(settings.shared_storage.path) == "/tmp/kvdi-x"


def test_extra_config_layers_over_kvdi_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_REDIS__KEY_PREFIX", "from-env:")
    monkeypatch.setenv("KVDI_REDIS__TTL_S", "60")
    settings = load_settings(**adapter.settings_overrides({"kvdi.redis.ttl_s": 5}))
    assert (settings.redis.key_prefix, settings.redis.ttl_s) == ("from-env:", 5)


def test_cpu_cache_written_by_vllm_kernel_round_trips_through_kvdi_blocks() -> None:
    """vLLM's own CPU kernel writes K/V; kvdi's block i is exactly vLLM's block i, bytes and all."""
    from vllm import _custom_ops as ops

    nb, heads, bs, dim = 4, SPEC.num_kv_heads, SPEC.block_size, SPEC.head_dim
    cache = torch.zeros(nb, heads, bs, 2 * dim)
    key_cache, value_cache = cache.view(nb, heads, 2 * bs, dim).chunk(2, dim=2)
    slots = torch.arange(40) + 5
    ops.cpu_attn_reshape_and_cache(
        torch.randn(40, heads, dim), torch.randn(40, heads, dim), key_cache, value_cache, slots, "vec"
    )

    view = adapter.kvdi_layer_view(cache, SPEC)

    assert view.data_ptr() == cache.data_ptr() and view.is_contiguous()
    assert view[1].numel() * view.element_size() == SPEC.layer_block_bytes
    assert torch.equal(view[1], cache[1])


def test_flash_attention_layout_is_viewed_in_kvdi_order() -> None:
    cache = torch.randn(2, 5, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    view = adapter.kvdi_layer_view(cache, SPEC, num_blocks=5)
    assert view.shape == (5, 2, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    assert torch.equal(view[3, 1], cache[1, 3])


def test_unknown_cache_shape_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"\(7, 3\)"):
        adapter.kvdi_layer_view(torch.zeros(7, 3), SPEC)


def test_layers_are_ordered_by_number_not_text() -> None:
    names = ["model.layers.10.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.0.self_attn.attn"]
    assert adapter.ordered_layers(names) == [names[2], names[1], names[0]]


def test_request_salt_covers_cache_salt_lora_and_images() -> None:
    plain = adapter.kv_request(
        SimpleNamespace(request_id="r", prompt_token_ids=[1, 2], cache_salt=None, lora_request=None, mm_features=[])
    )
    assert plain.cache_salt is None and plain.prompt_token_ids == (1, 2)
    lora = SimpleNamespace(lora_name="a")
    mm = [SimpleNamespace(identifier="img1")]
    salted = adapter.kv_request(
        SimpleNamespace(request_id="r", prompt_token_ids=[1], cache_salt="t", lora_request=lora, mm_features=mm)
    )
    assert salted.cache_salt is not None and all(part in salted.cache_salt for part in ("t", "lora=a", "mm=img1"))


def _output(new: list[Any], cached: Any, scheduled: dict[str, int], finished: set[str] | None = None) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        finished_req_ids=finished or set(),
    )


def _cached(req_ids: list[str], new_blocks: list[Any], computed: list[int], resumed: set[str] | None = None) -> Any:
    return SimpleNamespace(
        req_ids=req_ids, new_block_ids=new_blocks, num_computed_tokens=computed, resumed_req_ids=resumed or set()
    )


def test_tracker_rebuilds_full_block_lists_across_steps() -> None:
    tracker = adapter.RequestTracker()
    new = SimpleNamespace(req_id="a", prompt_token_ids=list(range(70)), block_ids=([4, 5],), num_computed_tokens=32)
    first = tracker.translate(_output([new], _cached([], [], []), {"a": 32}))
    assert first.scheduled[0].block_ids == (4, 5) and first.scheduled[0].num_computed_tokens == 32

    second = tracker.translate(_output([], _cached(["a"], [([9],)], [64]), {"a": 6}))
    assert second.scheduled[0].block_ids == (4, 5, 9) and second.scheduled[0].num_scheduled_tokens == 6

    resumed = tracker.translate(_output([], _cached(["a"], [([1, 2, 3],)], [0], {"a"}), {"a": 70}))
    assert resumed.scheduled[0].block_ids == (1, 2, 3)

    done = tracker.translate(_output([], _cached([], [], []), {}, {"a"}))
    assert done.finished_req_ids == frozenset({"a"}) and "a" not in tracker.blocks


def test_stats_aggregate_by_connector_name() -> None:
    a = adapter.KvdiConnectorStats(data={"shared_storage": {"loaded_blocks": 2}})
    b = adapter.KvdiConnectorStats(data={"shared_storage": {"loaded_blocks": 3, "saved_blocks": 1}})
    merged = a.aggregate(b)
    assert merged.reduce() == {"shared_storage.loaded_blocks": 5, "shared_storage.saved_blocks": 1}
    assert not merged.is_empty() and adapter.KvdiConnectorStats().is_empty()


def test_cpu_offload_uses_a_block_index_only_when_vllm_splits_scheduler_and_worker() -> None:
    def config(backend: str) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend))

    assert adapter.needs_block_index("cpu_offload", config("mp"))
    assert not adapter.needs_block_index("cpu_offload", config("uni"))
    assert not adapter.needs_block_index("shared_storage", config("mp"))


def test_block_index_counts_reported_prefixes_and_evicts_least_recent() -> None:
    index = adapter.BlockIndex(capacity=3)
    index.add([b"a", b"b"])
    assert index.count_prefix([b"a", b"b", b"c"]) == 2
    index.add([b"c", b"d"])  # over capacity: the least recently used key goes (b; a was the head of a hit)
    assert len(index) == 3 and index.count_prefix([b"b"]) == 0 and index.count_prefix([b"a"]) == 1
    index.discard(b"c")
    assert index.count_prefix([b"c", b"d"]) == 0 and index.count_prefix([b"d"]) == 1


def test_worker_metadata_aggregates_across_workers() -> None:
    merged = adapter.KvdiWorkerMetadata((b"a",), ()).aggregate(adapter.KvdiWorkerMetadata((b"b",), (b"x",)))
    assert (merged.stored, merged.dropped) == ((b"a", b"b"), (b"x",))


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
    views = {name: adapter.kvdi_layer_view(t, SPEC, num_blocks=6) for name, t in vllm_cache.items()}
    worker = _CopyingWorker()
    bridge = adapter.LayoutBridge(views, worker)
    assert not bridge.direct
    views["layers.0"][5] = 7.0
    meta = BlockTransferMetadata(
        loads=(BlockTransfer("r", (3, 4), (b"k3", b"k4")),), saves=(BlockTransfer("s", (5,), (b"k5",)),)
    )

    worker.bind_connector_metadata(bridge.bind(meta))
    worker.start_load_kv()
    bridge.after_load()
    bridge.before_save()
    worker.wait_for_save()

    assert torch.all(views["layers.1"][3] == 1.0)  # slot 0 -> vLLM block 3
    assert torch.all(views["layers.1"][4] == 0.0)  # slot 1 failed: not copied
    assert bridge.take_errors() == {4} and bridge.take_errors() == set()
    assert torch.all(worker.saved[b"k5"] == 7.0)
