"""shared_storage with ``format="canonical"``: kvdi's store halves write sections any TP shape reads (real files)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kvdi.connectors.base import (
    ConnectorContext,
    KVConnectorRole,
)
from kvdi.connectors.shared_storage import open_store
from kvdi.connectors.store import StoreWorkerConnector
from kvdi.connectors.store.canonical import RankPart, Section
from kvdi.connectors.store.canonical_io import CanonicalRank
from kvdi.connectors.store.canonical_store import CanonicalBlockStore
from kvdi.connectors.store.framing import unframe
from kvdi.errors import ConfigError
from kvdi.layout import KVCacheSpec
from kvdi.settings import KvdiSettings
from tests.helpers.canonical import BS, HEADS, KEYS, LAYERS, WHOLE, rank_layout, step
from tests.helpers.store import make_caches


def settings(root: Path, **extra: object) -> KvdiSettings:
    options = {"path": str(root), "format": "canonical", **extra}
    return KvdiSettings(kv_role="kv_both", engine_id="test", shared_storage=options)


def worker(
    root: Path, layout: KVCacheSpec, seed: int | None = None, **extra: object
) -> tuple[StoreWorkerConnector, dict]:
    s = settings(root, **extra)
    store = open_store(s.shared_storage, layout, s)
    half = StoreWorkerConnector(ConnectorContext("shared_storage", KVConnectorRole.WORKER, s, layout, None, store))
    caches = make_caches(layout, 16, seed)
    half.register_kv_caches(caches)
    return half, caches


def test_tp1_saves_and_each_tp2_rank_loads_its_head(tmp_path: Path) -> None:
    writer, src = worker(tmp_path, WHOLE, seed=1)
    assert step(writer, (0, 1, 2, 3), save=True) == set()
    assert writer.stats.saved_blocks == 4
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) == 4  # one pack a block (its sections: a head each)
    for rank in range(2):
        reader, dst = worker(tmp_path, rank_layout(rank))
        assert step(reader, (5, 6, 7, 8), save=False) == set()
        assert reader.stats.loaded_blocks == 4
        for name in WHOLE.layer_names:  # kvdi order [2, N, H, D]: this rank's head only
            assert torch.equal(dst[name][5:9], src[name][0:4][:, :, :, rank : rank + 1])


def test_tp2_ranks_save_and_tp1_loads_the_union(tmp_path: Path) -> None:
    parts = [worker(tmp_path, rank_layout(r), seed=10 + r) for r in range(2)]
    for half, _ in parts:
        assert step(half, (0, 1, 2, 3), save=True) == set()
    reader, dst = worker(tmp_path, WHOLE)
    assert step(reader, (4, 5, 6, 7), save=False) == set()
    for name in WHOLE.layer_names:
        for r, (_, src) in enumerate(parts):
            assert torch.equal(dst[name][4:8][:, :, :, r : r + 1], src[name][0:4])


def test_a_replica_holder_writes_nothing_and_reads_the_one_copy(tmp_path: Path) -> None:
    one = KVCacheSpec("m#canonical", LAYERS, 1, 8, BS, "float32")
    writers = [worker(tmp_path, rank_layout(r, heads=1), seed=3) for r in range(2)]
    for half, _ in writers:
        assert step(half, (0, 1, 2, 3), save=True) == set()
        assert half.stats.saved_blocks == 4  # rank 1's "save" succeeds with nothing to write
    assert [half.stats.saved_bytes for half, _ in writers] == [4 * writers[0][0]._block_bytes, 0]  # bytes it wrote
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 4  # one object per block: what a TP=1 writer stores
    reader, dst = worker(tmp_path, one)
    assert step(reader, (8, 9, 10, 11), save=False) == set()
    assert all(torch.equal(dst[n][8:12], writers[0][1][n][0:4]) for n in one.layer_names)


def test_a_missing_section_is_a_counted_load_error_on_every_rank_needing_it(tmp_path: Path) -> None:
    for rank in range(2):  # TP=2 writers: one pack a block and head
        writer, _ = worker(tmp_path, rank_layout(rank), seed=1 + rank)
        step(writer, (0, 1, 2, 3), save=True)
    store = worker(tmp_path, WHOLE)[0].store
    assert isinstance(store, CanonicalBlockStore)
    os.unlink(store.inner.path_for(Section(0, LAYERS, 1, 1).key(KEYS[2])))  # rank 1's pack (head 1) of block 2
    assert store.count_prefix(list(KEYS)) == 2  # the scheduler offers two blocks
    frames = store.get_many(list(KEYS))  # whole per-rank frames, for stores' callers without get_into_many
    assert frames[2] is None and all(f is not None for f in frames[:2])
    assert unframe(frames[0], WHOLE.fingerprint(), WHOLE.block_bytes, name=KEYS[0]).nbytes == WHOLE.block_bytes
    r0, _ = worker(tmp_path, rank_layout(0))
    r1, _ = worker(tmp_path, rank_layout(1))
    assert step(r0, (5, 6, 7, 8), save=False) == set()  # rank 0 never needs head 1
    assert step(r1, (5, 6, 7, 8), save=False) == {7, 8}
    assert r1.stats.loaded_blocks == 2 and isinstance(r1.store, CanonicalBlockStore)
    assert r1.store.misses["absent"] == 1


def test_hnc_sections_of_one_head_go_straight_to_the_cache_and_a_bad_one_is_still_a_miss(tmp_path: Path) -> None:
    hnc = KVCacheSpec("m#canonical", LAYERS, HEADS, 8, BS, "float32", block_order="hnc")
    writer, src = worker(tmp_path, hnc, seed=7)  # a section a head: each head's [N, 2D] of a layer is one run
    run = BS * 16 * 4
    assert isinstance(writer.store, CanonicalBlockStore) and writer.store.rank.write_runs == [0, run]
    assert step(writer, (0, 1, 2, 3), save=True) == set()
    victim = writer.store.inner.path_for(Section(0, LAYERS, 0, HEADS).key(KEYS[1]))  # its last byte: head 1's
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0x40
    victim.write_bytes(bytes(raw))
    reader, dst = worker(tmp_path, hnc)
    assert isinstance(reader.store, CanonicalBlockStore) and reader.store.rank.read_runs == [0, run]
    assert step(reader, (5, 6, 7, 8), save=False) == {6, 7, 8}
    assert reader.stats.loaded_blocks == 1 and reader.store.misses["checksum"] == 1
    assert all(torch.equal(dst[n][5], src[n][0]) for n in hnc.layer_names)


def test_nhc_sections_of_whole_layers_go_straight_to_the_cache_and_a_bad_one_is_still_a_miss(tmp_path: Path) -> None:
    nhc = KVCacheSpec("m#canonical", LAYERS, HEADS, 8, BS, "float32", block_order="nhc")
    writer, src = worker(tmp_path, nhc, seed=4, section_heads=HEADS)
    assert isinstance(writer.store, CanonicalBlockStore) and writer.store.rank.write_runs == [0]  # no conversion
    assert step(writer, (0, 1, 2, 3), save=True) == set()
    victim = writer.store.inner.path_for(Section(0, LAYERS, 0, HEADS).key(KEYS[2]))
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0x40  # one payload byte: only the section checksum can tell
    victim.write_bytes(bytes(raw))
    reader, dst = worker(tmp_path, nhc, section_heads=HEADS)
    assert isinstance(reader.store, CanonicalBlockStore) and reader.store.rank.read_runs == [0]
    assert step(reader, (5, 6, 7, 8), save=False) == {7, 8}
    assert reader.stats.loaded_blocks == 2 and reader.store.misses["checksum"] == 1
    assert all(torch.equal(dst[n][5:7], src[n][0:2]) for n in nhc.layer_names)
    g = reader.store.rank.geometry  # a reader of head 1 only: a section wider than its head, staged, converted
    r1 = CanonicalRank(reader.store.inner, g, RankPart(0, LAYERS, 1, 1, 1, 0), "nhc")
    assert r1.read_runs is None
    d1 = [[torch.zeros(BS, 1, 16) for _ in range(LAYERS)] for _ in KEYS]
    assert r1.load(list(zip(KEYS, d1, strict=True))) == 2  # the bad section was discarded: absent now
    assert r1.misses["absent"] == 1
    for b in range(2):  # a cache block's bytes are [N, H, 2D] under nhc
        assert all(
            torch.equal(d1[b][i], src[n][b].reshape(BS, HEADS, 16)[:, 1:2]) for i, n in enumerate(nhc.layer_names)
        )


def test_settings_refuse_a_grid_that_does_not_divide(tmp_path: Path) -> None:
    s = settings(tmp_path, section_layers=3)
    with pytest.raises(ConfigError, match="KVDI_SHARED_STORAGE__SECTION_LAYERS=3 / __SECTION_HEADS=1"):
        open_store(s.shared_storage, WHOLE, s)
    with pytest.raises(ValueError, match="format"):
        settings(tmp_path, format="canon")


def test_per_rank_stays_the_default(tmp_path: Path) -> None:
    s = KvdiSettings(kv_role="kv_both", engine_id="test", shared_storage={"path": str(tmp_path)})
    assert s.shared_storage.format == "per_rank"
    assert not isinstance(open_store(s.shared_storage, WHOLE, s), CanonicalBlockStore)


def test_a_canonical_rank_slice_names_blocks_alike_in_every_shape(tmp_path: Path) -> None:
    from kvdi.integrations.vllm.parallel import AllRanksStore, CanonicalShare, RankSlice

    share = CanonicalShare(num_layers=LAYERS, num_kv_heads=HEADS, layer_start=0, layer_count=LAYERS)
    tp2 = RankSlice(tp_size=2, tp_rank=1, canonical=share)
    assert tp2.layout_tag() == RankSlice(canonical=share).layout_tag() == "#canonical"
    assert tp2.key(KEYS[0]) == KEYS[0] and RankSlice(tp_size=2, tp_rank=1).key(KEYS[0]) != KEYS[0]
    assert rank_layout(1).model_id == "m" + tp2.layout_tag() + tp2.rank_tag()  # the worker's layout, parsed back
    writer, _ = worker(tmp_path, WHOLE, seed=1)
    step(writer, (0, 1, 2, 3), save=True)
    lookup = AllRanksStore(writer.store, tp2)  # the TP=2 scheduler's view: one lookup of every section
    assert lookup.count_prefix(list(KEYS)) == 4
    lookup.discard(KEYS[0])
    assert lookup.count_prefix(list(KEYS)) == 0
    store = writer.store
    assert isinstance(store, CanonicalBlockStore)
    pack = Section(0, LAYERS, 0, HEADS)  # the TP=1 writer's one pack a block
    assert not store.inner.path_for(pack.key(KEYS[0])).exists() and store.inner.path_for(pack.key(KEYS[1])).exists()


def test_a_hybrid_state_page_group_is_refused_not_misread(tmp_path: Path) -> None:
    grouped = KVCacheSpec("m#canonical", LAYERS, HEADS, 8, BS, "float32", group="mamba:16", page_bytes=64)
    s = settings(tmp_path)  # attention groups are sectioned: tests/connectors/test_canonical_hybrid.py
    with pytest.raises(ConfigError, match="KV cache group 'mamba:16'"):
        open_store(s.shared_storage, grouped, s)


def test_store_stats_tells_canonical_sections_from_per_rank_frames(tmp_path: Path) -> None:
    from kvdi.admin import open_admin, store_stats
    from kvdi.connectors.shared_storage import FileBlockStore
    from kvdi.connectors.store.framing import frame_header
    from kvdi.settings import load_settings

    writer, _ = worker(tmp_path, WHOLE, seed=1)
    step(writer, (0, 1, 2, 3), save=True)
    old = FileBlockStore(tmp_path)
    payload = bytes(WHOLE.block_bytes)
    old.put_many([(b"o" * 16, [frame_header(WHOLE.fingerprint(), payload, name=b"o" * 16), payload])])
    admin = open_admin(load_settings(shared_storage={"path": tmp_path}))
    try:
        stats = store_stats(admin)
    finally:
        admin.close()
    canonical = [g for name, g in stats.groups.items() if name.startswith("canonical:")]
    assert [g.objects for g in canonical] == [4] and stats.groups[WHOLE.fingerprint().hex()].objects == 1
    assert stats.total.objects == 4 + 1 and stats.foreign == 0  # one pack a block


def test_redis_canonical_tp1_saves_tp2_ranks_load(redis_server: Any) -> None:
    from kvdi.connectors.redis import open_store as open_redis

    def redis_worker(
        layout: KVCacheSpec, seed: int | None = None, **extra: object
    ) -> tuple[StoreWorkerConnector, dict]:
        options = {"url": redis_server.url, "format": "canonical", **extra}
        s = KvdiSettings(kv_connector="redis", kv_role="kv_both", engine_id="test", redis=options)
        store = open_redis(s.redis, layout, s)
        half = StoreWorkerConnector(ConnectorContext("redis", KVConnectorRole.WORKER, s, layout, None, store))
        caches = make_caches(layout, 16, seed)
        half.register_kv_caches(caches)
        return half, caches

    writer, src = redis_worker(WHOLE, seed=5)
    assert step(writer, (0, 1, 2, 3), save=True) == set() and writer.stats.saved_blocks == 4
    for rank in range(2):
        reader, dst = redis_worker(rank_layout(rank))
        assert step(reader, (5, 6, 7, 8), save=False) == set() and reader.stats.loaded_blocks == 4
        assert all(torch.equal(dst[n][5:9], src[n][0:4][:, :, :, rank : rank + 1]) for n in WHOLE.layer_names)
        reader.shutdown()
    writer.shutdown()
    nhc = KVCacheSpec("m#canonical", LAYERS, HEADS, 8, BS, "float32", block_order="nhc")
    w2, src2 = redis_worker(nhc, seed=6, section_heads=HEADS)  # sections that are runs of the cache: no copy
    assert step(w2, (0, 1, 2, 3), save=True) == set()
    r2, dst2 = redis_worker(nhc, section_heads=HEADS)
    assert isinstance(r2.store, CanonicalBlockStore) and r2.store.rank.read_runs == [0]  # GET into each layer
    assert step(r2, (5, 6, 7, 8), save=False) == set() and r2.stats.loaded_blocks == 4
    assert all(torch.equal(dst2[n][5:9], src2[n][0:4]) for n in nhc.layer_names)
    for half in (w2, r2):
        half.shutdown()
    with pytest.raises(ConfigError, match="KVDI_REDIS__COMPRESSION='zstd' with KVDI_REDIS__FORMAT=canonical"):
        redis_worker(WHOLE, compression="zstd")


def test_pp2_workers_save_and_a_tp2_worker_loads(tmp_path: Path) -> None:
    from kvdi.integrations.vllm.parallel import CanonicalShare, RankSlice

    def pp_layout(stage: int) -> KVCacheSpec:
        shape = RankSlice(pp_size=2, pp_rank=stage, canonical=CanonicalShare(4, HEADS, 2 * stage, 2))
        return KVCacheSpec("m" + shape.layout_tag() + shape.rank_tag(), 2, HEADS, 8, BS, "float32")

    def tp_layout(rank: int) -> KVCacheSpec:
        shape = RankSlice(tp_size=2, tp_rank=rank, canonical=CanonicalShare(4, HEADS, 0, 4))
        return KVCacheSpec("m" + shape.layout_tag() + shape.rank_tag(), 4, 1, 8, BS, "float32")

    def half(layout: KVCacheSpec, seed: int | None = None) -> tuple[StoreWorkerConnector, dict]:
        s = settings(tmp_path, section_layers=2)
        store = open_store(s.shared_storage, layout, s)
        w = StoreWorkerConnector(ConnectorContext("shared_storage", KVConnectorRole.WORKER, s, layout, None, store))
        caches = make_caches(layout, 16, seed)
        w.register_kv_caches(caches)
        return w, caches

    stages = [half(pp_layout(p), seed=20 + p) for p in range(2)]
    for w, _ in stages:
        assert step(w, (0, 1, 2, 3), save=True) == set()
    for rank in range(2):
        reader, dst = half(tp_layout(rank))
        assert step(reader, (5, 6, 7, 8), save=False) == set() and reader.stats.loaded_blocks == 4
        for layer in range(4):
            src = stages[layer // 2][1][f"layers.{layer % 2}"]
            assert torch.equal(dst[f"layers.{layer}"][5:9], src[0:4][:, :, :, rank : rank + 1])
    with pytest.raises(ConfigError, match="not whole sections"):
        s = settings(tmp_path)  # section_layers 0: one section of all 4 layers, which no PP stage holds
        open_store(s.shared_storage, pp_layout(0), s)
