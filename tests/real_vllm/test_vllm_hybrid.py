"""Hybrid models inside real vLLM (SupportsHMA): KV cache groups stored and loaded per group.

Tiny random models are written with transformers at test time (:mod:`hybrid_models`). With
kvdi configured vLLM keeps its hybrid KV cache manager on: the engine has more than one KV
cache group, its logged maximum concurrency equals the engine's without a connector, and
a second engine loads what the first stored with the tokens of an engine without kvdi.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.vllm_support import IN_PROCESS, kv_config, make_prompts, read_stats, require_vllm, run_engine

require_vllm()

from tests.real_vllm.hybrid_models import make_tiny_gemma3, max_concurrency  # noqa: E402

PROMPT_TOKENS = 200  # 6 full 32-token blocks; hits end at block 6
MAX_MODEL_LEN = 1024


def _groups(log: str) -> int:
    found = re.findall(r"KV cache groups: (\d+)", log)
    assert found, "kvdi logged no KV cache groups"
    return int(found[-1])


def _objects(store: Path) -> dict[bytes, list[Path]]:
    """Stored objects by the layout fingerprint in their frame header (one fingerprint per KV cache group)."""
    found: dict[bytes, list[Path]] = {}
    for path in store.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            found.setdefault(path.read_bytes()[8:24], []).append(path)
    return found


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three engines over one tiny Gemma3: no connector, kvdi storing, kvdi loading (one sliding object corrupt)."""
    work = tmp_path_factory.mktemp("gemma3")
    model = make_tiny_gemma3(work / "model")
    prompts = make_prompts(2, PROMPT_TOKENS, seed=7)
    spec: dict[str, Any] = {"model": str(model), "prompts": prompts, "max_model_len": MAX_MODEL_LEN, "max_tokens": 8}
    store = work / "store"

    def kvdi(name: str) -> dict[str, Any]:
        kv = kv_config("shared_storage", stats_dir=work / f"stats-{name}", shared_storage__path=str(store))
        return {**spec, "kv": kv, "drain": True}

    runs = {"base": run_engine(work, "base", spec, env=IN_PROCESS)}
    runs["store"] = run_engine(work, "store", kvdi("store"), env=IN_PROCESS)
    stored = {fp: len(paths) for fp, paths in _objects(store).items()}
    sliding = min(_objects(store).values(), key=len)[0]  # the sliding group stores fewer objects
    data = bytearray(sliding.read_bytes())
    data[-1] ^= 0xFF
    sliding.write_bytes(bytes(data))
    runs["load"] = run_engine(work, "load", kvdi("load"), env=IN_PROCESS)
    logs = {name: Path(run["log"]).read_text(errors="replace") for name, run in runs.items()}
    return {"runs": runs, "logs": logs, "stored": stored, "work": work, "store": store, "prompts": prompts}


def test_gemma3_keeps_several_kv_cache_groups_and_vllms_concurrency(gemma3: dict[str, Any]) -> None:
    logs = gemma3["logs"]
    assert _groups(logs["store"]) == 2
    assert "Turning off hybrid kv cache manager" not in logs["store"]
    assert max_concurrency(logs["store"]) == max_concurrency(logs["base"])


def test_gemma3_tokens_match_no_connector(gemma3: dict[str, Any]) -> None:
    runs = gemma3["runs"]
    expected = runs["base"]["rounds"][0]["tokens"]
    assert runs["store"]["rounds"][0]["tokens"] == expected
    assert runs["load"]["rounds"][0]["tokens"] == expected


def test_gemma3_sliding_group_stores_only_in_window_blocks(gemma3: dict[str, Any]) -> None:
    # full attention: 6 blocks per prompt; sliding window of 64 tokens = cdiv(63, 32) = 2 blocks per prompt
    assert sorted(gemma3["stored"].values()) == [2 * 2, 2 * 6]
    saved = read_stats(gemma3["work"] / "stats-store", "worker")
    assert saved["saved_blocks"] == 16


def test_gemma3_second_engine_loads_and_recomputes_the_corrupt_object(gemma3: dict[str, Any]) -> None:
    scheduler = read_stats(gemma3["work"] / "stats-load", "scheduler")
    worker = read_stats(gemma3["work"] / "stats-load", "worker")
    assert scheduler["lookup_hit_blocks"] >= 12  # both prompts hit 6 blocks (the failed one may be asked again)
    assert worker["corrupt_dropped"] == 1
    assert worker["loaded_blocks"] >= 8  # the clean prompt: 6 full-attention blocks and its 2-block window
    assert worker["finished_recving"] == 2
    drain = gemma3["runs"]["load"]["drain"]
    assert drain["requests_left"] == 0 and drain["free_blocks"] == drain["total_blocks"] - 1  # all but the null block
    # the failed request was recomputed and stored again
    assert sorted(len(p) for p in _objects(gemma3["store"]).values()) == [2 * 2, 2 * 6]
