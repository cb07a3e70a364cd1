"""Asynchronous loads in one engine step, and held saves vLLM's scheduler can see, in real vLLM.

- A load is reported finished receiving in the step it finished in, and an engine step that
  schedules nothing waits (``transfer.idle_load_wait_ms``) for loads in flight: the test counts
  the engine steps each load spanned (kvdi's ``load_steps_*`` counters) and prints them.
- vLLM 0.32's hooks: ``requires_kv_delivery`` is False for a store connector,
  ``has_pending_push_work`` is True while kvdi holds finished requests' blocks for their saves,
  and ``has_pending_block_frees`` makes vLLM wait for those blocks instead of preempting a
  running request (a 12-block KV cache, with and without the hook, preemptions printed).

Engines run in-process (``engine_probe.py`` reads vLLM's scheduler) and drain at the end; three
engine starts in all (the 12-block engine with and without the hook, then a loading engine).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.vllm_support import (
    HERE,
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

PROBE = HERE / "engine_probe.py"


def assert_drained(result: dict[str, Any]) -> None:
    drain = result["drain"]
    assert drain["requests_left"] == 0
    assert drain["free_blocks"] == drain["total_blocks"] - 1


def spans(worker: dict[str, float]) -> list[int]:
    """Engine steps per asynchronous load, from kvdi's histogram (4 stands for 4 or more)."""
    counts = {1: "load_steps_1", 2: "load_steps_2", 3: "load_steps_3", 4: "load_steps_4_or_more"}
    return [steps for steps, name in counts.items() for _ in range(int(worker.get(name, 0)))]


@pytest.fixture(scope="module")
def tiny_cache(
    tmp_path_factory: pytest.TempPathFactory, base_spec: dict[str, Any]
) -> dict[bool, tuple[dict[str, Any], Path]]:
    """A 12-block KV cache storing the prompts through a slow store with asynchronous saves (prompt 2 ends
    first and its saves keep its blocks held), with and without has_pending_block_frees; (result, work dir)."""
    runs = {}
    for pending_frees in (True, False):
        work = tmp_path_factory.mktemp(f"tiny-{pending_frees}")
        kv = kv_config(
            "slow_storage",
            stats_dir=work / "stats",
            shared_storage__path=str(work / "store"),
            kv_connector_module_path="slow_store",  # tests/real_vllm/slow_store.py, as a user plugs in a store
        )
        spec = {**base_spec, "kv": kv, "num_gpu_blocks": 12, "max_model_len": 256, "drain": True}
        spec.update(max_tokens_each=[40, 40, 8, 40], pending_frees=pending_frees, settle_s=6.0)
        runs[pending_frees] = (run_engine(work, "tiny", spec, env=IN_PROCESS, script=PROBE), work)
    return runs


def test_a_full_cache_waits_for_kvdis_held_blocks_instead_of_preempting(
    tiny_cache: dict[bool, tuple[dict[str, Any], Path]], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    (with_hook, work), (without, _) = tiny_cache[True], tiny_cache[False]
    preempted = {name: r["probes"]["preemptions"] for name, r in (("with", with_hook), ("without", without))}
    print(
        f"\n12-block cache, async saves: preemptions with has_pending_block_frees {preempted['with']}, "
        f"without {preempted['without']}; kvdi answered True {with_hook['probes']['pending_frees_true']} of "
        f"{with_hook['probes']['pending_frees_consulted']} times vLLM asked"
    )
    for result in (with_hook, without):
        assert [t[:8] for t in result["rounds"][0]["tokens"]] == baseline_tokens
        assert_drained(result)
    assert with_hook["probes"]["step_clock"] and without["probes"]["step_clock"]  # holds span steps, not seconds
    assert with_hook["probes"]["pending_frees_true"] >= 1  # vLLM waited for held blocks
    assert preempted["with"] < preempted["without"]
    assert read_stats(work / "stats", "worker")["saved_blocks"] == expected_saved(prompts)


def test_held_saves_are_pending_push_work_and_a_store_requires_no_delivery(
    tiny_cache: dict[bool, tuple[dict[str, Any], Path]], prompts: list[list[int]]
) -> None:
    result, work = tiny_cache[True]
    probes = result["probes"]
    print(f"\nprobes: {probes}")
    assert probes["requires_kv_delivery"] is False  # a cache is best effort: vLLM need not drop stale output
    # generate() returned with the last requests' saves held: vLLM keeps stepping until they come back ...
    assert probes["pending_push_work_after_generate"] == [True]
    # ... and once it drained, kvdi holds nothing and reported every saved request finished sending.
    assert probes["pending_push_work_at_end"] is False and probes["requests_at_end"] == 0
    worker = read_stats(work / "stats", "worker")
    assert worker["finished_sending"] == sum(1 for p in prompts if expected_saved([p]))


def test_async_loads_span_at_most_two_engine_steps_with_identical_tokens(
    tiny_cache: dict[bool, tuple[dict[str, Any], Path]],
    base_spec: dict[str, Any],
    prompts: list[list[int]],
    baseline_tokens: list[list[int]],
) -> None:
    """``transfer.async_load=on``: every hit waits in WAITING_FOR_REMOTE_KVS; the median load is reported
    within 2 engine steps of the step that started it (vLLM schedules it in the next)."""
    work = tiny_cache[True][1]  # what the 12-block engine stored, read as plain shared_storage
    stats = work / "stats-load"
    kv = kv_config("shared_storage", stats_dir=stats, shared_storage__path=str(work / "store"))
    kv["kv_connector_extra_config"]["kvdi.transfer.async_load"] = "on"

    result = run_engine(work, "async-load", {**base_spec, "kv": kv, "drain": True}, env=IN_PROCESS)

    assert result["rounds"][0]["tokens"] == baseline_tokens
    worker = read_stats(stats, "worker")
    with_hits = sum(1 for p in prompts if expected_blocks([p]))
    assert read_stats(stats, "scheduler")["async_load_requests"] == with_hits
    assert worker["loaded_blocks"] == expected_blocks(prompts)
    steps = spans(worker)
    print(
        f"\nsteps per asynchronous load: {sorted(steps)} (median {statistics.median(steps)}); "
        f"idle waits {worker['idle_load_waits']:.0f} ({1000 * worker['idle_load_wait_seconds']:.1f} ms)"
    )
    assert len(steps) == worker["finished_recving"] == with_hits
    assert statistics.median(steps) <= 2
    assert_drained(result)
