"""Hybrid models inside real vLLM (SupportsHMA): KV cache groups stored and loaded per group.

Tiny random models are written with transformers at test time (:mod:`hybrid_models`). With
kvdi configured vLLM keeps its hybrid KV cache manager on: the engine has more than one KV
cache group, its logged maximum concurrency equals the engine's without a connector, and
a second engine loads what the first stored with the tokens of an engine without kvdi.
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.vllm_support import IN_PROCESS, kv_config, make_prompts, read_stats, require_vllm, run_engine

require_vllm()

from tests.real_vllm.hybrid_models import make_tiny_gemma3, make_tiny_qwen3_next, max_concurrency  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 200  # 6 full 32-token blocks; hits end at block 6
MAX_MODEL_LEN = 4096  # the context vLLM logs its maximum concurrency for
# vLLM sizes a sliding-window group for a window plus one prefill chunk: with chunks of 4096 tokens (its CPU
# default) a 64-token window needs as much memory as full attention at 4096, with 512 it needs 18 blocks.
PREFILL_CHUNK = 512
QWEN3_NEXT_TOKENS = 1100  # vLLM raises the block size to a Mamba page (544 or 288 tokens by host): 2-3 full blocks


def _full_block_size(log: str) -> int:
    """The block size vLLM gave the full-attention group, as kvdi logged it. vLLM raises it to hold a Mamba page,
    whose size depends on the host: 544 tokens on some, 288 on others (``interface.py``: "Setting attention block
    size to N tokens")."""
    found = re.findall(r"g\d+:full:w\d+:bs(\d+):", log)
    assert found, "kvdi logged no full-attention group"
    return int(found[-1])


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


def test_groups_are_read_from_vllms_own_kv_cache_config() -> None:
    """kvdi's group planning over vLLM's KVCacheConfig and spec types (no engine)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    from kvdi.errors import ConfigError
    from kvdi.integrations.vllm.groups import groups_from_vllm

    attention = {"block_size": 32, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    shapes = {"shapes": ((3, 4), (2, 8)), "dtypes": (torch.float32, torch.float32)}
    mamba = MambaSpec(block_size=544, **shapes, mamba_cache_mode="align")
    groups = [
        KVCacheGroupSpec(["l.1"], FullAttentionSpec(**attention)),
        KVCacheGroupSpec(["l.0", "l.2"], SlidingWindowSpec(**attention, sliding_window=64)),
        KVCacheGroupSpec(["l.3"], mamba),
    ]
    full, sliding, state = groups_from_vllm(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups))
    assert (full.kind, full.block_size, full.num_kv_heads, full.head_dim) == ("full", 32, 2, 32)
    assert (sliding.kind, sliding.window, sliding.window_blocks, sliding.layer_names) == (
        "sliding",
        64,
        2,
        ("l.0", "l.2"),
    )
    assert (state.kind, state.block_size, state.page_bytes) == ("mamba", 544, mamba.page_size_bytes)
    mla = [KVCacheGroupSpec(["m"], MLAAttentionSpec(**attention))]
    with pytest.raises(ConfigError, match="MLAAttentionSpec"):
        groups_from_vllm(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=mla))
    unaligned = [KVCacheGroupSpec(["s"], MambaSpec(block_size=544, **shapes, mamba_cache_mode="none"))]
    with pytest.raises(ConfigError, match="mamba_cache_mode='align'.*enable-prefix-caching"):
        groups_from_vllm(KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=unaligned))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three engines over one tiny Gemma3: no connector, kvdi storing, kvdi loading (one sliding object corrupt)."""
    work = tmp_path_factory.mktemp("gemma3")
    model = make_tiny_gemma3(work / "model")
    prompts = make_prompts(2, PROMPT_TOKENS, seed=7)
    spec: dict[str, Any] = {
        "model": str(model),
        "prompts": prompts,
        "max_model_len": MAX_MODEL_LEN,
        "max_tokens": 8,
        "max_num_batched_tokens": PREFILL_CHUNK,
    }
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


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three engines over one tiny Qwen3-Next (linear attention + full, bf16): no connector, kvdi storing, loading."""
    work = tmp_path_factory.mktemp("qwen3-next")
    model = make_tiny_qwen3_next(work / "model")
    prompts = make_prompts(2, QWEN3_NEXT_TOKENS, seed=11)
    spec: dict[str, Any] = {
        "model": str(model),
        "prompts": prompts,
        "max_model_len": MAX_MODEL_LEN,
        "max_tokens": 8,
        "dtype": "bfloat16",
    }
    store = work / "store"
    runs = {"base": run_engine(work, "base", spec, env=IN_PROCESS)}
    for name in ("store", "load"):
        kv = kv_config("shared_storage", stats_dir=work / f"stats-{name}", shared_storage__path=str(store))
        runs[name] = run_engine(work, name, {**spec, "kv": kv, "drain": True}, env=IN_PROCESS)
    logs = {name: Path(run["log"]).read_text(errors="replace") for name, run in runs.items()}
    return {"runs": runs, "logs": logs, "work": work, "store": store}


def test_qwen3_next_starts_with_kvdi_and_keeps_vllms_concurrency(qwen3_next: dict[str, Any]) -> None:
    logs = qwen3_next["logs"]
    assert _groups(logs["store"]) == 2
    assert "g0:mamba" in logs["store"]
    assert max_concurrency(logs["store"]) == max_concurrency(logs["base"])


def test_qwen3_next_second_engine_loads_the_state_and_blocks(qwen3_next: dict[str, Any]) -> None:
    runs = qwen3_next["runs"]
    expected = runs["base"]["rounds"][0]["tokens"]
    assert runs["store"]["rounds"][0]["tokens"] == expected
    assert runs["load"]["rounds"][0]["tokens"] == expected
    # per prompt: its full-attention blocks and one linear-attention state (the one ending at the hit boundary)
    blocks = (QWEN3_NEXT_TOKENS - 1) // _full_block_size(qwen3_next["logs"]["store"])
    assert blocks >= 2, "the prompts must span two full blocks at least"
    assert sorted(len(p) for p in _objects(qwen3_next["store"]).values()) == sorted([2 * 1, 2 * blocks])
    loaded = read_stats(qwen3_next["work"] / "stats-load", "worker")
    assert loaded["loaded_blocks"] == 2 * (blocks + 1) and loaded["finished_recving"] == 2
    assert read_stats(qwen3_next["work"] / "stats-load", "scheduler")["lookup_hit_blocks"] == 2 * blocks


def test_gemma3_tp2_each_rank_stores_and_loads_its_slice_of_each_group(gemma3: dict[str, Any]) -> None:
    """TP=2 (``mp`` executor): each rank stores its slice of each group's blocks; a second engine loads them."""
    work, prompts = gemma3["work"], gemma3["prompts"]
    spec: dict[str, Any] = {
        "model": str(work / "model"),
        "prompts": prompts,
        "max_model_len": MAX_MODEL_LEN,
        "max_tokens": 8,
        "max_num_batched_tokens": PREFILL_CHUNK,
        "tensor_parallel_size": 2,
        "executor": "mp",
    }
    runs = {}
    for name in ("tp2-store", "tp2-load"):
        kv = kv_config("shared_storage", stats_dir=work / f"stats-{name}", shared_storage__path=str(work / "tp2"))
        runs[name] = run_engine(work, name, {**spec, "kv": kv}, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert _groups(Path(runs["tp2-store"]["log"]).read_text(errors="replace")) == 2
    assert runs["tp2-load"]["rounds"][0]["tokens"] == runs["tp2-store"]["rounds"][0]["tokens"]

    def ranks(name: str, counter: str) -> list[int]:
        files = sorted(glob.glob(str(work / f"stats-{name}" / "*-worker-*.json")))
        return [json.loads(Path(f).read_text())[counter] for f in files]

    assert ranks("tp2-store", "saved_blocks") == [16, 16]  # per rank: 12 full-attention blocks, 4 in-window
    assert ranks("tp2-load", "loaded_blocks") == [16, 16]
    # one layout fingerprint per group per rank
    assert sorted(len(p) for p in _objects(work / "tp2").values()) == [4, 4, 12, 12]
