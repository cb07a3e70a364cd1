"""Canonical sections of a hybrid model's KV cache groups (real files): each attention group is sectioned like a
model whose layers are the group's, its fingerprint naming the group; state-page groups are refused.

The model is Gemma-style: 4 layers, sliding (0, 2) and full (1, 3), 2 KV heads, as vLLM's groups
(:mod:`kvdi.integrations.vllm.groups`) and kvdi's hybrid halves (:func:`~kvdi.integrations.vllm.hybrid.group_layouts`)
lay them out for a TP=2 worker rank, a TP=1 worker and their schedulers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorRole,
    run_transfer_step,
)
from kvdi.connectors.shared_storage import open_store
from kvdi.connectors.store import StoreWorkerConnector
from kvdi.connectors.store.canonical import Section
from kvdi.connectors.store.canonical_store import CanonicalBlockStore, geometry_of, part_tag
from kvdi.connectors.store.keys import block_keys
from kvdi.errors import ConfigError
from kvdi.integrations.vllm.groups import GroupSpec
from kvdi.integrations.vllm.hybrid import group_layouts
from kvdi.integrations.vllm.parallel import CanonicalShare, RankSlice
from kvdi.layout import KVCacheSpec
from kvdi.settings import KvdiSettings
from tests.helpers.store import make_caches

LAYERS, HEADS, DIM, BS = 4, 2, 8, 4
TOKENS = list(range(4 * BS + 1))


def groups(tp: int) -> list[GroupSpec]:
    """vLLM's two attention groups as a rank of a TP=``tp`` engine reports them (its own KV heads)."""
    heads = HEADS // tp
    return [
        GroupSpec(0, "sliding", ("l.0", "l.2"), BS, window=2 * BS, num_kv_heads=heads, head_dim=DIM),
        GroupSpec(1, "full", ("l.1", "l.3"), BS, num_kv_heads=heads, head_dim=DIM),
    ]


def shape(tp: int, rank: int = 0) -> RankSlice:
    return RankSlice(tp, 1, rank, 0, CanonicalShare(LAYERS, HEADS, 0, LAYERS))


def worker_layouts(tp: int, rank: int) -> list[KVCacheSpec]:
    """What vLLM's worker rank ``rank`` of TP=``tp`` gets per group (its base layout tagged with its share)."""
    base = KVCacheSpec(f"m{part_tag(0, LAYERS, LAYERS, rank, tp, HEADS)}", LAYERS, HEADS // tp, DIM, BS, "float32")
    return group_layouts(base, groups(tp), shape(tp, rank), worker=True)


def scheduler_keys(tp: int) -> list[tuple[bytes, ...]]:
    """Each group's block keys of :data:`TOKENS` as the scheduler of a TP=``tp`` engine derives them."""
    base = KVCacheSpec("m#canonical", LAYERS, HEADS, DIM, BS, "float32")  # the whole model (layout_from_vllm)
    return [tuple(block_keys(TOKENS, lay)) for lay in group_layouts(base, groups(tp), shape(tp), worker=False)]


def worker(root: Path, layout: KVCacheSpec, seed: int | None = None) -> tuple[StoreWorkerConnector, dict]:
    s = KvdiSettings(kv_role="kv_both", engine_id="t", shared_storage={"path": str(root), "format": "canonical"})
    store = open_store(s.shared_storage, layout, s)
    half = StoreWorkerConnector(ConnectorContext("shared_storage", KVConnectorRole.WORKER, s, layout, None, store))
    caches = make_caches(layout, 16, seed)
    half.register_kv_caches(caches)
    return half, caches


def step(half: StoreWorkerConnector, keys: tuple[bytes, ...], ids: tuple[int, ...], save: bool) -> set[int]:
    """Save (or load) ``keys`` from (into) blocks ``ids`` in one step, flushed; the blocks that failed."""
    transfer = (BlockTransfer("r", ids, keys[: len(ids)]),)
    failed = run_transfer_step(half, BlockTransferMetadata(() if save else transfer, transfer if save else ()))
    half.flush()
    return failed


def files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]


def test_every_tp_shape_names_a_groups_blocks_alike_and_groups_apart() -> None:
    one, two = scheduler_keys(1), scheduler_keys(2)
    assert one == two  # TP=1 and TP=2 schedulers: the same keys per group
    assert not set(one[0]) & set(one[1])  # the groups' keys never meet
    fps = {geometry_of(lay)[0].fingerprint() for tp in (1, 2) for lay in worker_layouts(tp, tp - 1)}
    assert len(fps) == 2  # one fingerprint per group, whatever the shape


def test_tp2_ranks_write_each_group_and_tp1_loads_each_group(tmp_path: Path) -> None:
    keys = scheduler_keys(2)
    ranks = [[worker(tmp_path, lay, seed=10 * r + g) for g, lay in enumerate(worker_layouts(2, r))] for r in (0, 1)]
    for per_group in ranks:
        for g, (half, _) in enumerate(per_group):
            assert step(half, keys[g], (0, 1, 2, 3), save=True) == set()
            assert half.stats.saved_blocks == 4
    assert len(files(tmp_path)) == 2 * 4 * 2  # per group, block and TP rank: one pack (here: of one head)
    for g, lay in enumerate(worker_layouts(1, 0)):
        reader, dst = worker(tmp_path, lay)
        assert step(reader, scheduler_keys(1)[g], (5, 6, 7, 8), save=False) == set()
        assert reader.stats.loaded_blocks == 4
        for name in lay.layer_names:  # kvdi order [2, N, H, D]: head r is rank r's
            for r in (0, 1):
                assert torch.equal(dst[name][5:9][:, :, :, r : r + 1], ranks[r][g][1][name][0:4])


def test_a_corrupt_section_is_a_counted_miss_of_its_group_only(tmp_path: Path) -> None:
    keys = scheduler_keys(1)
    layouts = worker_layouts(1, 0)
    for g, lay in enumerate(layouts):
        writer, _ = worker(tmp_path, lay, seed=g)
        step(writer, keys[g], (0, 1, 2, 3), save=True)
    full = writer.store
    assert isinstance(full, CanonicalBlockStore)
    victim = full.inner.path_for(Section(0, 2, 0, HEADS).key(keys[1][1]))  # full group's pack of block 1
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0x10  # in its last section: head 1's
    victim.write_bytes(bytes(raw))
    for r, lay in enumerate(worker_layouts(2, 0) + worker_layouts(2, 1)):  # rank 1 needs head 1, rank 0 does not
        g = r % 2
        reader, _ = worker(tmp_path, lay)
        failed = step(reader, keys[g], (5, 6, 7, 8), save=False)
        assert isinstance(reader.store, CanonicalBlockStore)
        if g == 1 and r >= 2:  # (then the pack is discarded: a bad pack goes for every rank, rewritten at a save)
            assert failed == {6, 7, 8} and reader.store.misses["checksum"] == 1
            assert reader.stats.loaded_blocks == 1
        else:
            assert failed == set() and reader.stats.loaded_blocks == 4


def test_a_section_of_one_group_never_loads_as_another_groups(tmp_path: Path) -> None:
    keys = scheduler_keys(1)
    sliding, full = worker_layouts(1, 0)
    writer, _ = worker(tmp_path, sliding, seed=1)
    step(writer, keys[0], (0, 1, 2, 3), save=True)
    assert isinstance(writer.store, CanonicalBlockStore)
    store = writer.store.inner
    src = store.path_for(Section(0, 2, 0, HEADS).key(keys[0][0]))  # the sliding group's pack copied where the
    dst = store.path_for(Section(0, 2, 0, HEADS).key(keys[1][0]))  # full group's would be
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes())
    reader, _ = worker(tmp_path, full)
    assert step(reader, keys[1], (5,), save=False) == {5}
    assert isinstance(reader.store, CanonicalBlockStore) and reader.store.misses["fingerprint"] == 1


def test_state_page_groups_and_pipeline_stages_of_a_group_are_refused_in_one_line(tmp_path: Path) -> None:
    base = KVCacheSpec("m#canonical", LAYERS, HEADS, DIM, BS, "float32")
    mamba = GroupSpec(2, "mamba", ("l.4",), 544, page_bytes=4096)
    (state,) = group_layouts(base, [mamba], shape(1), worker=False)
    with pytest.raises(
        ConfigError, match=r"cannot store KV cache group 'g2:mamba:[^']*': .*Mamba.*use format per_rank"
    ):
        worker(tmp_path, state)
    stage = KVCacheSpec(f"m{part_tag(0, 2, LAYERS, 0, 1, HEADS)}", 2, HEADS, DIM, BS, "float32")
    (sliding,) = group_layouts(stage, groups(1)[:1], shape(1), worker=True)
    with pytest.raises(ConfigError, match=r"group 'g0:sliding:.*' of a pipeline-parallel stage.*per_rank"):
        worker(tmp_path, sliding)
