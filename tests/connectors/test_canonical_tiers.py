"""multi with canonical tiers: a per-process cpu_offload tier in front of canonical shared_storage or redis.

Every shape's ranks write their sections to the shared canonical tier and their own per-rank frames to their
own pool (a process of its own each, as vLLM's workers are); another shape reads the shared tier, a rank
re-reads its pool. A per-rank tier other processes reach beside a canonical one is refused in one line.
Real files, a real Redis server on loopback.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dependency_injector import providers

from kvdi.connectors.base import (
    ConnectorContext,
    KVConnectorRole,
)
from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.multi import TieredStore
from kvdi.connectors.store import StoreWorkerConnector
from kvdi.connectors.store.canonical_store import CanonicalBlockStore
from kvdi.containers import KVTransferContainer, build_kv_container
from kvdi.errors import ConfigError
from kvdi.integrations.vllm.parallel import stores_canonical
from kvdi.layout import KVCacheSpec
from tests.helpers.canonical import HEADS, KEYS, WHOLE, rank_layout, step
from tests.helpers.store import make_caches


class Engines:
    """Worker halves over ``multi`` stores built by real containers (each its own pool, as a process of its own)."""

    def __init__(self, **options: Any) -> None:
        self.options = options
        self.containers: list[KVTransferContainer] = []

    def container(self, layout: KVCacheSpec) -> KVTransferContainer:
        c = build_kv_container(kv_connector="multi", engine_id="test", kv_role="kv_both", **self.options)
        c.layout.override(providers.Object(layout))
        self.containers.append(c)
        return c

    def worker(
        self, layout: KVCacheSpec, seed: int | None = None
    ) -> tuple[StoreWorkerConnector, dict[str, torch.Tensor], TieredStore]:
        c = self.container(layout)
        store = c.backend()
        assert isinstance(store, TieredStore)
        ctx = ConnectorContext("multi", KVConnectorRole.WORKER, c.settings(), layout, None, store)
        half = StoreWorkerConnector(ctx)
        caches = make_caches(layout, 16, seed)
        half.register_kv_caches(caches)
        return half, caches, store

    def close(self) -> None:
        for c in self.containers:
            c.shutdown_resources()


def pool_of(store: TieredStore) -> HostPoolStore:
    pool = store.tiers[0][1]
    assert isinstance(pool, HostPoolStore)
    return pool


@pytest.fixture
def files(kvdi_env: Path, tmp_path: Path) -> Iterator[Engines]:
    e = Engines(
        multi={"tiers": ["cpu_offload", "shared_storage"]},
        cpu_offload={"max_bytes": 1 << 20},
        shared_storage={"path": str(tmp_path / "kv"), "format": "canonical"},
        transfer={"async_save": False, "async_load": "off"},
    )
    yield e
    e.close()


def test_tp2_ranks_fill_their_pools_and_the_shared_sections_tp1_loads_them(files: Engines, tmp_path: Path) -> None:
    ranks = [files.worker(rank_layout(r), seed=10 + r) for r in range(2)]
    for half, _, store in ranks:
        assert isinstance(store.tiers[1][1], CanonicalBlockStore)
        assert step(half, (0, 1, 2, 3), save=True) == set()
        assert len(pool_of(store)) == 4  # this rank's own frames, in its own pool
    assert len([p for p in (tmp_path / "kv").rglob("*") if p.is_file()]) == 4 * HEADS  # a section a block, a head
    whole, dst, store = files.worker(WHOLE)  # another shape, another process: its pool is empty
    assert len(pool_of(store)) == 0 and store.count_prefix(list(KEYS)) == 4
    assert step(whole, (4, 5, 6, 7), save=False) == set() and whole.stats.loaded_blocks == 4
    for n in WHOLE.layer_names:
        assert all(torch.equal(dst[n][4:8][:, :, :, r : r + 1], ranks[r][1][n][0:4]) for r in range(2))
    for p in (tmp_path / "kv").rglob("*"):  # the shared tier gone: rank 1 still reads its own pool
        if p.is_file():
            p.unlink()
    half, src, _ = ranks[1]
    assert step(half, (8, 9, 10, 11), save=False) == set() and half.stats.loaded_blocks == 4
    assert all(torch.equal(src[n][8:12], src[n][0:4]) for n in src)


def test_redis_canonical_behind_a_pool_serves_another_shape(kvdi_env: Path, redis_server: Any) -> None:
    e = Engines(
        multi={"tiers": ["cpu_offload", "redis"]},
        cpu_offload={"max_bytes": 1 << 20},
        redis={"url": redis_server.url, "format": "canonical"},
        transfer={"async_save": False, "async_load": "off"},
    )
    try:
        writer, src, _ = e.worker(WHOLE, seed=5)
        assert step(writer, (0, 1, 2, 3), save=True) == set()
        for rank in range(2):
            reader, dst, store = e.worker(rank_layout(rank))
            assert len(pool_of(store)) == 0
            assert step(reader, (5, 6, 7, 8), save=False) == set() and reader.stats.loaded_blocks == 4
            assert all(torch.equal(dst[n][5:9], src[n][0:4][:, :, :, rank : rank + 1]) for n in WHOLE.layer_names)
    finally:
        e.close()


def test_a_shared_per_rank_tier_beside_a_canonical_one_is_refused_in_one_line(
    kvdi_env: Path, tmp_path: Path, redis_server: Any
) -> None:
    options: dict[str, Any] = {
        "multi": {"tiers": ["cpu_offload", "shared_storage", "redis"]},
        "shared_storage": {"path": str(tmp_path / "kv"), "format": "canonical"},
        "redis": {"url": redis_server.url},
    }
    e = Engines(**options)
    try:
        with pytest.raises(ConfigError, match=r"tier 'redis' stores per-rank frames beside canonical tier") as err:
            e.container(WHOLE).backend()
        assert "\n" not in str(err.value) and "KVDI_REDIS__FORMAT=canonical" in str(err.value)
        both = Engines(**{**options, "redis": {"url": redis_server.url, "format": "canonical"}})
        store = both.container(WHOLE).backend()  # every shared tier canonical: fine
        assert [type(s) for _, s in store.tiers] == [HostPoolStore, CanonicalBlockStore, CanonicalBlockStore]
        both.close()
    finally:
        e.close()


def test_the_composite_names_blocks_canonically_when_any_tier_is_canonical(kvdi_env: Path, tmp_path: Path) -> None:
    from kvdi.settings import load_settings

    path = str(tmp_path / "kv")
    tiers = {"tiers": ["cpu_offload", "shared_storage"]}
    assert stores_canonical(load_settings(kv_connector="multi", multi=tiers, shared_storage={"format": "canonical"}))
    assert not stores_canonical(load_settings(kv_connector="multi", multi=tiers, shared_storage={"path": path}))
    assert stores_canonical(load_settings(kv_connector="redis", redis={"format": "canonical"}))
    assert not stores_canonical(load_settings(kv_connector="cpu_offload"))
    assert not stores_canonical(load_settings(kv_connector="p2p"))


def test_cpu_offload_refuses_a_canonical_format_in_one_line(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdi.settings import load_settings

    monkeypatch.setenv("KVDI_CPU_OFFLOAD__FORMAT", "canonical")
    with pytest.raises(ConfigError, match=r"KVDI_CPU_OFFLOAD__FORMAT='canonical'.*allowed: per_rank") as err:
        load_settings(kv_connector="cpu_offload")
    monkeypatch.delenv("KVDI_CPU_OFFLOAD__FORMAT")
    assert "\n" not in str(err.value)
    assert load_settings(kv_connector="cpu_offload").cpu_offload.format == "per_rank"


def test_canonical_share_reads_the_tiers_from_vllms_transfer_config(kvdi_env: Path, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from kvdi.integrations.vllm.parallel import CanonicalShare, canonical_share

    def vllm_config(extra: dict[str, Any]) -> Any:
        model = SimpleNamespace(
            get_layers_start_end_indices=lambda parallel: (2, 4),  # PP stage 1 of 2
            get_total_num_hidden_layers=lambda: 4,
            get_total_num_kv_heads=lambda: 8,
        )
        transfer = SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_both", engine_id="e")
        return SimpleNamespace(model_config=model, parallel_config=None, kv_transfer_config=transfer)

    path = str(tmp_path / "kv")
    tiers = {"kvdi.kv_connector": "multi", "kvdi.multi.tiers": ["cpu_offload", "shared_storage"]}
    share = canonical_share(
        vllm_config({**tiers, "kvdi.shared_storage.path": path, "kvdi.shared_storage.format": "canonical"})
    )
    assert share == CanonicalShare(num_layers=4, num_kv_heads=8, layer_start=2, layer_count=2)
    assert canonical_share(vllm_config({**tiers, "kvdi.shared_storage.path": path})) is None
    assert canonical_share(
        vllm_config({"kvdi.kv_connector": "s3", "kvdi.s3.bucket": "b-1", "kvdi.s3.format": "canonical"})
    )
    assert canonical_share(vllm_config({"kvdi.kv_connector": "cpu_offload"})) is None


def test_an_s3_tier_left_per_rank_is_named_with_where_its_options_come_from(kvdi_env: Path, tmp_path: Path) -> None:
    from kvdi.connectors.multi import check_tier_formats
    from kvdi.containers import resolve_tiers
    from kvdi.registry import ConnectorRegistry
    from kvdi.settings import load_settings

    pytest.importorskip("boto3")
    s = load_settings(
        kv_connector="multi",
        multi={"tiers": ["shared_storage", "s3"]},
        shared_storage={"path": str(tmp_path), "format": "canonical"},
        kv_connector_extra_config={"bucket": "kv-cache"},
    )
    registry = ConnectorRegistry()
    tiers = resolve_tiers(registry, registry.resolve("multi"), s.multi, s)
    with pytest.raises(ConfigError, match=r"tier 's3' stores per-rank .* \(set format canonical in s3's options\)"):
        check_tier_formats(tiers)
