"""Canonical sections of a hybrid model in real vLLM (CPU): a tiny Gemma3's two attention groups, sectioned per group.

A TP=1 engine with ``shared_storage.format="canonical"`` stores each group's blocks as canonical sections (one
per block and KV head, in one pack a block: the fingerprint naming the group); a TP=2 engine (mp executor)
loads them, each rank its KV head's sections of each group (its byte range of each pack) (in-process engine core). Tokens are compared with the writer's, which
loaded nothing. TP=2 writing and TP=1 reading is covered at the store level
(tests/connectors/test_canonical_hybrid.py).
"""

from __future__ import annotations

import glob
import json
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.vllm_support import IN_PROCESS, kv_config, make_prompts, read_stats, require_vllm, run_engine

require_vllm()

from tests.real_vllm.hybrid_models import make_tiny_gemma3  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 200  # 6 full 32-token blocks; hits end at block 6
PREFILL_CHUNK = 512  # a small sliding-window group (tests/real_vllm/test_vllm_hybrid.py)
KV_HEADS = 2  # the tiny Gemma3's


def test_gemma3_groups_stored_as_canonical_sections_by_tp1_load_in_tp2(tmp_path: Path) -> None:
    from kvdi.connectors.store.canonical import frame_kind

    model = make_tiny_gemma3(tmp_path / "model")
    prompts = make_prompts(2, PROMPT_TOKENS, seed=7)
    spec: dict[str, Any] = {
        "model": str(model),
        "prompts": prompts,
        "max_model_len": 1024,
        "max_tokens": 8,
        "max_num_batched_tokens": PREFILL_CHUNK,
    }
    store = tmp_path / "store"

    def kvdi(name: str) -> dict[str, Any]:
        kv = kv_config(
            "shared_storage",
            stats_dir=tmp_path / f"stats-{name}",
            shared_storage__path=str(store),
            shared_storage__format="canonical",
        )
        return {**spec, "kv": kv}

    runs = {"store": run_engine(tmp_path, "store", kvdi("store"), env=IN_PROCESS)}
    tp2 = {**kvdi("load"), "tensor_parallel_size": 2, "executor": "mp"}
    runs["load"] = run_engine(tmp_path, "load", tp2, env={**IN_PROCESS, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    # the writer found an empty store and loaded nothing: its tokens are those of no connector (the baseline
    # engine test_vllm_hybrid.py runs for this model asserts that), so none is started here (CI time)
    assert read_stats(tmp_path / "stats-store", "worker")["loaded_blocks"] == 0
    assert runs["load"]["rounds"][0]["tokens"] == runs["store"]["rounds"][0]["tokens"]

    datas = [p.read_bytes() for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert {frame_kind(d[:4]) for d in datas} == {"canonical"}
    per_group = Counter(d[8:24] for d in datas)  # the fingerprint names the group
    # per prompt: 6 full-attention blocks, the sliding window's 2 (tests/real_vllm/test_vllm_hybrid.py), one pack
    # each of KV_HEADS sections (a section: 128-byte header, then its payload)
    assert sorted(per_group.values()) == [2 * 2, 2 * 6]
    assert all(struct.unpack_from("<Q", d, 80)[0] * KV_HEADS + 128 * KV_HEADS == len(d) for d in datas)
    assert read_stats(tmp_path / "stats-store", "worker")["saved_blocks"] == 16
    ranks = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(str(tmp_path / "stats-load" / "*-worker-*")))]
    assert [r["loaded_blocks"] for r in ranks] == [16, 16]  # each rank its KV head of 2 x (6 full + 2 in-window)
    assert read_stats(tmp_path / "stats-load", "scheduler")["lookup_hit_blocks"] == 12
