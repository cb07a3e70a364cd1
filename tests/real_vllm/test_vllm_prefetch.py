"""Prefetch at lookup (``transfer.async_load=prefetch``) inside real vLLM engines.

A lookup that finds a hit answers vLLM "ask again" while kvdi's worker fetches the hit into bounded host
staging (the request holds no KV block meanwhile); the worker's report travels back through vLLM's
worker-to-scheduler metadata, and the next lookup loads exactly the staged blocks synchronously, from host
memory. Shown here:

- Redis (one server) with vLLM's in-process and its multiprocess engine core (and `auto`'s path, a synchronous
  load, in the multiprocess core), and a 3-master Redis
  Cluster: greedy tokens equal no connector, every hit loaded through staging;
- a store with slow reads (a remote store, as far as timing goes), 24 concurrent requests, a staging
  bound that fits 4 of their hits: the bound holds at every engine step, the other hits take the plain
  path, two requests aborted while their prefetch runs free their staging, and a corrupt object under
  prefetch is a counted miss whose request is recomputed; staging and reservation are empty once drained;
- ``kv_load_failure_policy=fail`` under ``auto`` with a store that says it is remote (so ``auto`` prefetches):
  the request whose staged block is corrupt fails, the others are served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.redis import require_redis_tools
from tests.real_vllm.vllm_support import (
    HERE,
    IN_PROCESS,
    corrupt_copy,
    expected_blocks,
    expected_saved,
    kv_config,
    make_prompts,
    read_stats,
    require_vllm,
    run_engine,
)

require_vllm()

pytestmark = [pytest.mark.slow, pytest.mark.redis]

MULTIPROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
PROBE = HERE / "prefetch_probe.py"
FRAME_BYTES = 32768 + 88  # the tiny Llama's block (2 layers, K and V, 32 tokens x 2 heads x 32 x fp32) + header
MANY = make_prompts(24, 100, seed=7)  # 3 loadable blocks each
BOUND = 4 * 3 * FRAME_BYTES  # host staging for 4 of those hits


def _require_redis() -> None:

    require_redis_tools()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory, base_spec: dict[str, Any]) -> Any:
    """A Redis server on loopback holding the prompts' KV, stored by one engine (no prefetch)."""
    from kvdi.testing.redis_server import RedisServer

    _require_redis()
    work = tmp_path_factory.mktemp("prefetch-redis")
    with RedisServer() as server:
        kv = kv_config("redis", stats_dir=work / "stats", redis__url=server.url)
        run_engine(work, "redis-producer", {**base_spec, "kv": kv}, env=IN_PROCESS)
        yield server.url, work


@pytest.mark.parametrize(
    ("path", "mode"), [("prefetch", "in-process"), ("prefetch", "multiprocess"), ("auto", "multiprocess")]
)
def test_redis_hits_load_with_the_tokens_of_no_connector(
    path: str,
    mode: str,
    redis_url: tuple[str, Path],
    base_spec: dict[str, Any],
    prompts: list[list[int]],
    baseline_tokens: list[list[int]],
) -> None:
    """Prefetch in both engine-core modes (every hit through staging), and the path ``auto`` picks for Redis
    (a synchronous load) in the multiprocess core, the one ``vllm serve`` uses."""
    url, work = redis_url
    stats = work / f"stats-{path}-{mode}"
    kv = kv_config("redis", stats_dir=stats, redis__url=url, transfer__async_load=path)
    env = IN_PROCESS if mode == "in-process" else MULTIPROCESS
    result = run_engine(work, f"{path}-{mode}", {**base_spec, "kv": kv}, env=env)

    assert result["rounds"][0]["tokens"] == baseline_tokens
    scheduler, worker = read_stats(stats, "scheduler"), read_stats(stats, "worker")
    assert worker["loaded_blocks"] == expected_blocks(prompts) and worker["corrupt_dropped"] == 0
    assert scheduler.get("async_load_requests", 0) == 0  # neither path parks a request
    log = Path(result["log"]).read_text()
    # auto measures the store's lookup round trip at start: Redis on loopback is local (well under 1 ms), so no
    # prefetch; the log says which it decided, and the counters must agree with it.
    prefetched = "prefetch at lookup on" in log
    assert prefetched if path == "prefetch" else (prefetched or "async_load=auto: a local store" in log)
    if prefetched:  # every hit went through staging: reported by the worker, then loaded synchronously
        assert scheduler["prefetch_reported"] == sum(1 for p in prompts if expected_blocks([p]))
        assert scheduler["prefetch_staged_blocks"] == expected_blocks(prompts)
    else:
        assert scheduler.get("prefetch_reported", 0) == 0


def test_lookups_behind_5_ms_leave_the_scheduler_step_and_hits_load_with_the_tokens_of_no_connector(
    redis_url: tuple[str, Path],
    base_spec: dict[str, Any],
    prompts: list[list[int]],
    baseline_tokens: list[list[int]],
) -> None:
    """Redis 5 ms away (kvdi's latency proxy), every setting at its default: ``scheduler.lookup=auto`` measures
    the store and looks up in the background (vLLM told "ask again" meanwhile), then the hit is prefetched and
    loaded; greedy tokens equal no connector's and every stored block is loaded."""
    from kvdi.testing.latency_proxy import LatencyProxy

    url, work = redis_url
    stats = work / "stats-async-lookups"
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with LatencyProxy(("127.0.0.1", port), delay_ms=5) as proxy:
        kv = kv_config("redis", stats_dir=stats, redis__url=proxy.url("redis"))
        result = run_engine(work, "async-lookups", {**base_spec, "kv": kv}, env=IN_PROCESS)

    assert result["rounds"][0]["tokens"] == baseline_tokens
    log = Path(result["log"]).read_text()
    assert "store lookups in the background, batched per step (async: auto, store lookup" in log
    assert read_stats(stats, "worker")["loaded_blocks"] == expected_blocks(prompts)
    assert read_stats(stats, "scheduler")["lookups"] == len(prompts)  # one answered lookup per request


def test_redis_cluster_hits_are_prefetched_then_loaded(
    tmp_path: Path, base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    from kvdi.testing.redis_server import RedisClusterServers

    _require_redis()
    with RedisClusterServers(masters=3) as cluster:
        stats = [tmp_path / "stats-producer", tmp_path / "stats-consumer"]
        common = {"redis__url": cluster.url, "redis__cluster": True}
        run_engine(
            tmp_path, "producer", {**base_spec, "kv": kv_config("redis", stats_dir=stats[0], **common)}, IN_PROCESS
        )
        kv = kv_config("redis", stats_dir=stats[1], transfer__async_load="prefetch", **common)
        result = run_engine(tmp_path, "consumer", {**base_spec, "kv": kv}, env=IN_PROCESS)

    assert result["rounds"][0]["tokens"] == baseline_tokens
    assert read_stats(stats[0], "worker")["saved_blocks"] == expected_saved(prompts)
    assert read_stats(stats[1], "scheduler")["prefetch_staged_blocks"] == expected_blocks(prompts)
    assert read_stats(stats[1], "worker")["loaded_blocks"] == expected_blocks(prompts)


@pytest.fixture(scope="module")
def slow_store(tmp_path_factory: pytest.TempPathFactory, base_spec: dict[str, Any]) -> dict[str, Any]:
    """24 prompts stored in a file store (by an engine of the same store with fast reads); their tokens."""
    work = tmp_path_factory.mktemp("prefetch-slow")
    store = work / "store"
    kv = kv_config("shared_storage", stats_dir=work / "stats", shared_storage__path=str(store))
    result = run_engine(work, "producer", {**base_spec, "prompts": MANY, "kv": kv}, env=IN_PROCESS)
    return {"work": work, "store": store, "tokens": result["rounds"][0]["tokens"]}


def _slow_kv(store: Path, stats: Path, load: str = "prefetch", **kvdi: Any) -> dict[str, Any]:
    """The slow store's transfer config; ``kvdi`` become more ``kvdi.<key>`` settings (kvdi's policy decides)."""
    return kv_config(
        "slow_reads",
        stats_dir=stats,
        kv_connector_module_path="slow_store",  # tests/real_vllm/slow_store.py, as a user plugs in a store
        shared_storage__path=str(store),
        transfer__async_load=load,
        transfer__prefetch_max_bytes=BOUND,
        **kvdi,
    )


def _corrupt_run(
    slow_store: dict[str, Any],
    name: str,
    spec: dict[str, Any],
    load: str = "prefetch",
    script: Path | None = None,
    **extra: Any,
) -> tuple[dict[str, Any], Path]:
    """One in-process engine over a copy of the slow store whose prompt 0 has a corrupt block 0; (result, stats dir)."""
    store, stats = corrupt_copy(slow_store, f"store-{name}", MANY[0]), slow_store["work"] / f"stats-{name}"
    run = {**spec, "kv": _slow_kv(store, stats, load, **extra)}
    scripts = {"script": script} if script is not None else {}
    return run_engine(slow_store["work"], name, run, env=IN_PROCESS, **scripts), stats


def test_staging_stays_bounded_under_24_requests_aborts_free_it_and_a_corrupt_block_is_recomputed(
    slow_store: dict[str, Any], base_spec: dict[str, Any]
) -> None:
    spec = {**base_spec, "prompts": MANY, "abort": [1, 2]}
    result, stats = _corrupt_run(slow_store, "probe", spec, script=PROBE)

    probes = result["probes"]
    print(f"\nprobes: {probes}")
    tokens, reasons = result["rounds"][0]["tokens"], result["rounds"][0]["finish_reasons"]
    assert reasons[1:3] == ["abort", "abort"] and probes["aborted_while_staging"] == [1, 2]
    kept = [i for i in range(len(MANY)) if i not in (1, 2)]
    assert [tokens[i] for i in kept] == [slow_store["tokens"][i] for i in kept]  # prompt 0 recomputed
    assert 0 < probes["max_staged_bytes"] <= BOUND and probes["refused"] == 0
    assert probes["fallbacks"] > 0  # hits past the bound took the plain path
    assert probes["staged_bytes_at_end"] == probes["staged_requests_at_end"] == probes["reserved_at_end"] == 0
    assert probes["requests_at_end"] == 0
    worker = read_stats(stats, "worker")
    assert worker["corrupt_dropped"] == 1


def test_a_corrupt_staged_block_under_fail_policy_fails_only_its_request(
    slow_store: dict[str, Any], base_spec: dict[str, Any]
) -> None:
    spec = {**base_spec, "prompts": MANY[:4]}
    # auto, with a store that says it is remote: prefetch
    result, stats = _corrupt_run(slow_store, "fail", spec, "auto", kv_load_failure_policy="fail")

    first = result["rounds"][0]
    assert first["finish_reasons"][0] == "error"
    assert first["tokens"][1:] == slow_store["tokens"][1:4]
    assert read_stats(stats, "worker")["corrupt_dropped"] == 1
    assert read_stats(stats, "scheduler")["prefetch_reported"] == 4


def test_a_stalled_store_past_the_load_deadline_is_recomputed_with_the_tokens_of_no_connector(
    slow_store: dict[str, Any], base_spec: dict[str, Any], baseline_tokens: list[list[int]]
) -> None:
    """``scheduler.load_deadline`` on, a store whose reads stall (0.3 s each: far longer than recomputing 96
    tokens): the module's prompts (misses) compute first, so the engine's prefill rate is measured; the 4 stored
    hits' prefetches then run past their deadline, are abandoned and recomputed (counted), never waited for;
    greedy tokens equal no connector's and no abandoned prefetch's bytes are loaded."""
    spec = {**base_spec, "prompts": base_spec["prompts"] + MANY[:4]}
    stats = slow_store["work"] / "stats-deadline"
    kv = _slow_kv(slow_store["store"], stats, scheduler__load_deadline=True)
    result = run_engine(slow_store["work"], "deadline", {**spec, "kv": kv}, env=IN_PROCESS)

    assert result["rounds"][0]["tokens"] == baseline_tokens + slow_store["tokens"][:4]
    scheduler, worker = read_stats(stats, "scheduler"), read_stats(stats, "worker")
    recomputed = scheduler["deadline_recomputes"]
    assert recomputed >= 1
    assert worker["loaded_blocks"] == 3 * (4 - recomputed)  # an abandoned prefetch loads nothing


def test_background_loads_of_a_stalled_store_past_the_load_deadline_are_cancelled_with_the_tokens_of_no_connector(
    slow_store: dict[str, Any], base_spec: dict[str, Any]
) -> None:
    """The same, with ``transfer.async_load=on``: the 4 hits load in the background, already holding their KV blocks
    (vLLM parks their requests); past the deadline each is cancelled (counted), reported finished receiving with its
    blocks failed, and vLLM recomputes it: greedy tokens equal no connector's, the cancelled loads' bytes never land
    (``loaded_blocks`` counts only the loads that finished). Its misses are prompts no test of the module stores
    (the one above saves the module's prompts into the store)."""
    misses = make_prompts(4, 100, seed=77)
    spec = {**base_spec, "prompts": misses + MANY[:4]}
    stats = slow_store["work"] / "stats-deadline-background"
    kv = _slow_kv(slow_store["store"], stats, "on", scheduler__load_deadline=True)
    result = run_engine(slow_store["work"], "deadline-background", {**spec, "kv": kv}, env=IN_PROCESS)

    assert result["rounds"][0]["tokens"][4:] == slow_store["tokens"][:4]
    scheduler, worker = read_stats(stats, "scheduler"), read_stats(stats, "worker")
    recomputed = scheduler["deadline_recomputes"]
    assert recomputed >= 1
    assert worker["loaded_blocks"] == 3 * (4 - recomputed)
