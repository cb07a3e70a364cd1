"""LLMEngine end to end: loading a producer's prefix through a connector changes nothing but the work done."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvdi.containers import EngineContainer, build_engine_container
from kvdi.engine.engine import LLMEngine, RequestOutput
from tests.helpers.engine import BLOCK_SIZE, small_settings

Make = Callable[..., EngineContainer]
NEW_TOKENS = 5


def make_prompts(n: int, seed: int = 0, lengths: tuple[int, ...] = (9, 13, 16, 17, 30)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


PROMPTS = make_prompts(5)


@pytest.fixture
def baseline(make_container: Make) -> list[RequestOutput]:
    engine: LLMEngine = make_container().engine()
    return engine.generate(PROMPTS, NEW_TOKENS)


@pytest.fixture
def consumer(make_container: Make, store_connector: dict[str, Any]) -> list[RequestOutput]:
    make_container(kv_role="kv_producer", **store_connector).engine().generate(PROMPTS, NEW_TOKENS)
    engine: LLMEngine = make_container(kv_role="kv_consumer", **store_connector).engine()
    return engine.generate(PROMPTS, NEW_TOKENS)


def test_consumer_generates_the_same_tokens_as_the_null_connector(
    baseline: list[RequestOutput], consumer: list[RequestOutput]
) -> None:
    assert [o.output_token_ids for o in consumer] == [o.output_token_ids for o in baseline]


def test_consumer_first_token_logits_are_within_1e_4(
    baseline: list[RequestOutput], consumer: list[RequestOutput]
) -> None:
    for ours, theirs in zip(consumer, baseline, strict=True):
        assert ours.first_token_logits is not None and theirs.first_token_logits is not None
        torch.testing.assert_close(ours.first_token_logits, theirs.first_token_logits, atol=1e-4, rtol=0)


def test_consumer_computes_only_the_tokens_after_the_loaded_blocks(consumer: list[RequestOutput]) -> None:
    """Whole blocks of 4 load, leaving at least the last prompt token to compute (9 -> 8, 16 -> 12, 17 -> 16)."""
    assert BLOCK_SIZE == 4 and [len(p) for p in PROMPTS] == [9, 13, 16, 17, 30]
    assert [(o.num_loaded_tokens, o.num_computed_prompt_tokens) for o in consumer] == [
        (8, 1),
        (12, 1),
        (12, 4),
        (16, 1),
        (28, 2),
    ]


def test_null_connector_loads_nothing_and_computes_every_prompt_token(baseline: list[RequestOutput]) -> None:
    assert [(o.num_loaded_tokens, o.num_computed_prompt_tokens) for o in baseline] == [(0, len(p)) for p in PROMPTS]


def test_outputs_come_back_in_prompt_order(baseline: list[RequestOutput]) -> None:
    assert [list(o.prompt_token_ids) for o in baseline] == PROMPTS
    assert all(len(o.output_token_ids) == NEW_TOKENS and o.ok for o in baseline)


def test_chunked_prefill_generates_the_same_tokens(make_container: Make, baseline: list[RequestOutput]) -> None:
    chunked = make_container(scheduler={"max_num_batched_tokens": 7, "max_num_seqs": 2}).engine()
    assert [o.output_token_ids for o in chunked.generate(PROMPTS, NEW_TOKENS)] == [o.output_token_ids for o in baseline]


def test_setting_kvdi_kv_connector_switches_the_connector(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    settings = small_settings()
    del settings["kv_connector"]
    monkeypatch.setenv("KVDI_SHARED_STORAGE__PATH", str(tmp_path))
    used = []
    for name in ("null", "shared_storage"):
        monkeypatch.setenv("KVDI_KV_CONNECTOR", name)
        container = build_engine_container(**settings)
        engine = container.engine()
        used.append((engine.connector_stats().connector, type(engine.worker.connector).__name__))
        container.shutdown_resources()
    assert used == [("null", "NullWorkerConnector"), ("shared_storage", "StoreWorkerConnector")]


def test_connector_stats_count_the_bytes_moved(make_container: Make, store_connector: dict[str, Any]) -> None:
    producer = make_container(kv_role="kv_producer", **store_connector).engine()
    producer.generate(PROMPTS, 1)
    consumer = make_container(kv_role="kv_consumer", **store_connector).engine()
    outs = consumer.generate(PROMPTS, 1)
    loaded = consumer.connector_stats().total
    assert loaded.loaded_blocks == sum(o.num_loaded_tokens for o in outs) // BLOCK_SIZE
    assert loaded.loaded_bytes > 0 and producer.connector_stats().total.saved_bytes > 0


def test_generate_reports_time_to_first_token(baseline: list[RequestOutput]) -> None:
    assert all(o.time_to_first_token_s is not None and o.time_to_first_token_s > 0 for o in baseline)


def test_block_pool_is_whole_after_generate(make_container: Make) -> None:
    engine = make_container().engine()
    engine.generate(PROMPTS, NEW_TOKENS)
    assert engine.block_pool.whole
