"""Every KV cache layout vLLM 0.32 can resolve, through kvdi's vLLM adapter and real store halves (no engine).

vLLM's own code builds each cache (``get_kv_cache_config_from_groups``, ``allocate_kv_cache``,
``create_kv_cache_views``, ``compute_layout_strides``, the ``KVCacheLayout`` enum and the hybrid
spec types; see :mod:`tests.real_vllm.layout_support`; vLLM 0.32's attention backends no longer
shape caches themselves: ``get_kv_cache_shape`` is gone from all but one MLA backend). A
``KvdiConnector`` registers it and saves random blocks to ``shared_storage``; a fresh engine
of the same or another layout loads them into other block ids, compared byte for byte per
layer and per K/V against the source blocks in vLLM's logical ``[B, H, N, C]`` terms.

Kernel blocks split a manager block only under the layer-compact layouts (LBNHC, LBHNC):
vLLM's ``prepare_kernel_block_sizes`` never splits block-outermost packing and
``create_kv_cache_views`` refuses a split of any layout whose blocks are not dense pages.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.real_vllm.vllm_support import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from kvdi.errors import ConfigError  # noqa: E402
from kvdi.integrations.vllm.layout import kv_cache_spec, kvdi_layer_view  # noqa: E402
from tests.real_vllm.layout_support import (  # noqa: E402
    BLOCK,
    DTYPES,
    LAYERS,
    LAYOUTS,
    NUM_BLOCKS,
    Engine,
    logical_block,
    vllm_config,
)

SAVED = [5, 1, 9]  # vLLM block ids of the prompt's three blocks in the writer (group 0; see _ids)
LOADED = [2, 10, 4]
SPLITS = [
    (layout, kernel)
    for layout in LAYOUTS
    for kernel in (None, BLOCK // 2)
    if kernel is None or (layout[0] == "L" and layout[1] == "B")
]


def _ids(base: list[int], group: int) -> list[int]:
    """Block ids of ``group``: groups overlay one buffer and a block id belongs to one group at a time."""
    return [(b + 3 * group) % 12 for b in base]


def _same_order_other(layout: str, kind: str = "one") -> str:
    """Another layout that stores blocks in the same byte order (a mixed fleet that must share blocks)."""
    peers = [m for m in _layouts(kind) if _heads_first(m) == _heads_first(layout) and m != layout]
    return peers[0]


def _heads_first(layout: str) -> bool:
    """Whether a block of ``layout`` holds its heads outside its tokens (vLLM's per-layer view order)."""
    order = KVCacheLayout[layout].layer_view_order  # physical order of the logical [B, H, N, C] axes
    return order.index(1) < order.index(2)


def _layouts(kind: str) -> list[str]:
    """The layouts vLLM can resolve for ``kind``: with Mamba pages (another HNC shape) only block-compact ones
    (``resolve_kv_cache_layout``), since the groups alias one page per block."""
    return [m.name for m in KVCacheLayout if kind != "mamba" or m.is_block_compact]


def _round_trip(
    tmp_path: Path,
    tiny_model: Path,
    dtype: str,
    writer_layout: str,
    reader_layout: str,
    kind: str,
    kernel: int | None,
    reader_kernel: int | None,
    tp: int = 1,
    rank: int = 0,
) -> None:
    config = vllm_config(tiny_model, dtype, tp)
    store = tmp_path / "store"
    writer = Engine(config, store, "writer", writer_layout, kind, kernel, rank, seed=1)
    groups = len(writer.kv_config.kv_cache_groups)
    sources = {
        name: [logical_block(writer.caches[name], b) for b in _ids(SAVED, g)]
        for g, group in enumerate(writer.kv_config.kv_cache_groups)
        for name in group.layer_names
    }
    try:
        writer.step(saves=[_ids(SAVED, g) for g in range(groups)])
        assert writer.connector.half.stats.saved_blocks == 3 * groups
    finally:
        writer.close()

    reader = Engine(config, store, "reader", reader_layout, kind, reader_kernel, rank)
    try:
        errors, failed = reader.load([_ids(LOADED, g) for g in range(groups)])
        assert not errors and not failed
        for g, group in enumerate(reader.kv_config.kv_cache_groups):
            for name in group.layer_names:
                for i, block in enumerate(_ids(LOADED, g)):
                    got = logical_block(reader.caches[name], block)
                    assert all(torch.equal(a, b) for a, b in zip(got, sources[name][i], strict=True)), (name, i)
    finally:
        reader.close()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("layout", "kernel"), SPLITS)
def test_one_group_round_trips_under_the_same_and_another_layout(
    tmp_path: Path, tiny_model: Path, layout: str, kernel: int | None, dtype: str
) -> None:
    """Each layout (and kernel split) registers, saves, and loads back byte for byte into a fresh engine of the
    same layout and of another layout with the same block order (a split writer is read by an unsplit one)."""
    _round_trip(tmp_path / "same", tiny_model, dtype, layout, layout, "one", kernel, kernel)
    _round_trip(tmp_path / "other", tiny_model, dtype, layout, _same_order_other(layout), "one", kernel, None)


HYBRIDS = [
    (layout, kind, kernel)
    for kind in ("sliding", "mamba")
    for layout, kernel in SPLITS
    if layout in _layouts(kind) and (kernel is None or kind == "sliding")  # vLLM never splits Mamba pages
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("layout", "kind", "kernel"), HYBRIDS)
def test_hybrid_groups_round_trip_under_every_layout(
    tmp_path: Path, tiny_model: Path, layout: str, kind: str, kernel: int | None, dtype: str
) -> None:
    """Sliding + full attention (kernel blocks too), and Mamba pages (padded to the attention page) + full
    attention: each group's blocks come back byte for byte, per layer and K/V, into a fresh engine of the same
    and of another layout."""
    _round_trip(tmp_path / "same", tiny_model, dtype, layout, layout, kind, kernel, kernel)
    _round_trip(tmp_path / "other", tiny_model, dtype, layout, _same_order_other(layout, kind), kind, kernel, None)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("kind", ["one", "sliding"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tensor_parallel_slices_round_trip_under_every_layout(
    tmp_path: Path, tiny_model: Path, layout: str, kind: str, rank: int
) -> None:
    """Under TP=2 each rank's slice (one KV head) of every layout, one group or hybrid, round-trips under its own
    rank's keys."""
    _round_trip(tmp_path, tiny_model, "float16", layout, _same_order_other(layout), kind, None, None, 2, rank)


def test_another_block_order_is_a_counted_miss_never_wrong_bytes(tmp_path: Path, tiny_model: Path) -> None:
    """An LBNHC store read by an LBHNC engine: its keys differ (nothing is offered), and even under the writer's
    own keys every frame fails its layout check: counted, dropped, and each block it touched is reported failed
    (vLLM recomputes those), so no block vLLM keeps holds bytes of the other order."""
    config = vllm_config(tiny_model, "float16", 1)
    writer = Engine(config, tmp_path, "nhc", "LBNHC", seed=2)
    try:
        writer.step(saves=[SAVED])
        writer_keys = writer.keys
    finally:
        writer.close()
    reader = Engine(config, tmp_path, "hnc", "LBHNC")
    try:
        assert not set(reader.keys[0]) & set(writer_keys[0])
        before = [logical_block(reader.caches[LAYERS[0]], b) for b in range(NUM_BLOCKS)]

        errors, _ = reader.load([LOADED], keys=writer_keys)

        stats = reader.connector.half.stats
        assert stats.loaded_blocks == 0 and stats.corrupt_dropped == 1  # the chain stops at its first bad block
        after = [logical_block(reader.caches[LAYERS[0]], b) for b in range(NUM_BLOCKS)]
        touched = {b for b in range(NUM_BLOCKS) if not all(map(torch.equal, before[b], after[b]))}
        assert LOADED[0] in errors and touched <= errors
    finally:
        reader.close()


def test_a_quantized_cache_is_refused_in_one_line_naming_layout_and_dtype(tiny_model: Path) -> None:
    """fp8 KV caches are refused when the connector is built: one line with the layout, the dtype, what works."""
    config = vllm_config(tiny_model, "float16", 1)
    config.cache_config.kv_cache_layout = "LBNHC"
    config.cache_config.cache_dtype = "fp8"
    try:
        with pytest.raises(ConfigError) as err:
            kv_cache_spec(config)
    finally:
        config.cache_config.cache_dtype = "auto"
    message = str(err.value)
    assert "\n" not in message and "'fp8'" in message and "LBNHC" in message and "kv_cache_dtype='auto'" in message


@pytest.mark.parametrize(("layout", "kernel"), SPLITS)
def test_block_compact_layouts_are_addressed_without_a_copy(
    tmp_path: Path, tiny_model: Path, layout: str, kernel: int | None
) -> None:
    """Where every block is one run in the stored order (layer- or block-outermost, block-compact, an ``nhc``
    split) kvdi addresses vLLM's memory itself; only LHBNC, BHLNC and a split ``hnc`` block go through scratch."""
    from kvdi.integrations.vllm.views import block_rows

    engine = Engine(vllm_config(tiny_model, "float16", 1), tmp_path, "view", layout, kernel=kernel)
    try:
        views = {name: kvdi_layer_view(cache, engine.connector.layout) for name, cache in engine.caches.items()}
        zero_copy = all(v.is_contiguous() for v in views.values()) or block_rows(views) is not None
        compact = KVCacheLayout[layout].is_block_compact and (kernel is None or not _heads_first(layout))
        assert zero_copy == compact
    finally:
        engine.close()
