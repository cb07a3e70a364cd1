"""Canonical sections on real vLLM (CPU): TP=1 writes, TP=2 (mp executor) reads and writes, TP=1 reads.

``shared_storage.format="canonical"`` names blocks without the parallel shape, so the TP=2 engine's
scheduler finds the TP=1 engine's blocks and each rank loads its own KV head from them; the blocks
the TP=2 engine computes, each rank writes its head's sections of, and a second TP=1 engine loads
the union (docs/stored-format.md). Tokens are compared with the no-connector baseline.
"""

from __future__ import annotations

import glob
import json
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


def test_tp1_writes_tp2_reads_and_writes_tp1_reads(
    tmp_path: Path, base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    from kvdi.connectors.store.canonical import frame_kind

    store = tmp_path / "store"

    def kv(name: str) -> dict[str, Any]:
        options = {"shared_storage__path": str(store), "shared_storage__format": "canonical"}
        return kv_config("shared_storage", stats_dir=tmp_path / f"stats-{name}", **options)

    def stored() -> list[Path]:
        return [p for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")]

    heads = [p[:BLOCK_SIZE] for p in prompts]  # TP=1 writes each prompt's first block, TP=2 the rest
    run_engine(tmp_path, "tp1-writer", {**base_spec, "prompts": heads, "kv": kv("tp1")}, env=IN_PROCESS)
    files = stored()
    assert files and {frame_kind(p.read_bytes()[:4]) for p in files} == {"canonical"}
    assert len(files) == 2 * expected_saved(heads)  # the tiny Llama's 2 KV heads: one section each

    spec = {**base_spec, "tensor_parallel_size": 2, "executor": "mp", "kv": kv("tp2")}
    reader = run_engine(tmp_path, "tp2-reader", spec, env=TP_ENV)
    assert reader["rounds"][0]["tokens"] == baseline_tokens
    ranks = [
        json.loads(Path(f).read_text()) for f in sorted(glob.glob(str(tmp_path / "stats-tp2" / "*-worker-*.json")))
    ]
    assert [r["loaded_blocks"] for r in ranks] == [len(prompts)] * 2  # every prompt's first block
    assert read_stats(tmp_path / "stats-tp2", "scheduler")["lookup_hit_blocks"] == len(prompts)
    assert len(stored()) == 2 * expected_saved(prompts)  # each rank wrote its head of the blocks it computed

    again = run_engine(tmp_path, "tp1-reader", {**base_spec, "kv": kv("tp1-reader")}, env=IN_PROCESS)
    assert again["rounds"][0]["tokens"] == baseline_tokens
    assert read_stats(tmp_path / "stats-tp1-reader", "worker")["loaded_blocks"] == expected_blocks(prompts)
