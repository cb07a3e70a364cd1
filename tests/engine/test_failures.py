"""Failures end a request (or are recomputed) without disturbing others or leaking KV blocks."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvdi.connectors.base import loadable_tokens
from kvdi.containers import EngineContainer
from kvdi.engine.engine import LLMEngine
from tests.helpers.engine import BLOCK_SIZE

Make = Callable[..., EngineContainer]
PROMPTS = [[(7 * i + j) % 256 for j in range(9 + 4 * i)] for i in range(4)]


def corrupt_store(root: Path) -> int:
    """Truncate every stored object under ``root``; returns how many."""
    files = [p for p in root.rglob("*") if p.is_file()]
    for path in files:
        path.write_bytes(path.read_bytes()[:10])
    return len(files)


@pytest.fixture
def corrupted(make_container: Make, store_connector: dict[str, Any]) -> dict[str, Any]:
    """Settings of a store whose every object the producer wrote was then truncated."""
    make_container(kv_role="kv_producer", **store_connector).engine().generate(PROMPTS, 1)
    assert corrupt_store(Path(store_connector["shared_storage"]["path"])) > 0
    return store_connector


def test_failed_loads_are_recomputed_under_recompute(make_container: Make, corrupted: dict[str, Any]) -> None:
    expected = make_container().engine().generate(PROMPTS, 3)
    engine = make_container(kv_role="kv_consumer", kv_load_failure_policy="recompute", **corrupted).engine()
    outs = engine.generate(PROMPTS, 3)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in expected]
    assert [(o.num_loaded_tokens, o.num_computed_prompt_tokens) for o in outs] == [(0, len(p)) for p in PROMPTS]


def test_failed_loads_end_the_request_under_fail(make_container: Make, corrupted: dict[str, Any]) -> None:
    engine = make_container(kv_role="kv_consumer", kv_load_failure_policy="fail", **corrupted).engine()
    out = engine.generate(PROMPTS[:1], 3)[0]
    assert out.error is not None and out.output_token_ids == ()
    assert out.request_id in out.error and "kv_load_failure_policy=recompute" in out.error


def test_a_failed_load_does_not_stop_other_requests(make_container: Make, corrupted: dict[str, Any]) -> None:
    engine = make_container(kv_role="kv_consumer", kv_load_failure_policy="fail", **corrupted).engine()
    short = [1, 2, 3]  # nothing loadable: computed, not loaded
    outs = engine.generate([PROMPTS[0], short], 3)
    assert outs[0].error is not None
    assert outs[1].ok and len(outs[1].output_token_ids) == 3


def test_failed_request_returns_its_blocks(make_container: Make, corrupted: dict[str, Any]) -> None:
    engine = make_container(kv_role="kv_consumer", kv_load_failure_policy="fail", **corrupted).engine()
    engine.generate(PROMPTS, 3)
    assert engine.block_pool.whole


def test_prompt_longer_than_the_model_fails_with_a_clear_error(make_container: Make) -> None:
    out = make_container().engine().generate([[1] * 600], 2)[0]
    assert out.error is not None and "KVDI_MODEL__MAX_MODEL_LEN" in out.error


def test_prompt_that_needs_more_blocks_than_exist_fails_with_a_clear_error(make_container: Make) -> None:
    engine = make_container(allocator={"device": "cpu", "block_size": BLOCK_SIZE, "num_blocks": 4}).engine()
    out = engine.generate([[1] * 20], 2)[0]
    assert out.error is not None and "KVDI_ALLOCATOR__NUM_BLOCKS" in out.error
    assert engine.block_pool.whole


def test_requests_wait_for_blocks_instead_of_failing(make_container: Make) -> None:
    engine = make_container(allocator={"device": "cpu", "block_size": BLOCK_SIZE, "num_blocks": 6}).engine()
    outs = engine.generate([[5] * 18, [6] * 18, [7] * 18], 4)  # each needs 6 blocks: one at a time
    assert all(o.ok and len(o.output_token_ids) == 4 for o in outs)


def test_empty_prompt_and_unknown_token_ids_fail(make_container: Make) -> None:
    outs = make_container().engine().generate([[], [1, 999]], 2)
    assert outs[0].error is not None and "empty" in outs[0].error
    assert outs[1].error is not None and "vocab" in outs[1].error


def mixed_prompts(rng: random.Random, prefixes: list[list[int]], n: int) -> list[list[int]]:
    """Shared prefixes (loads), fresh prompts, too-long prompts, empty and out-of-vocabulary prompts."""
    out: list[list[int]] = []
    for i in range(n):
        kind = i % 10
        if kind == 7:
            out.append([1] * 600)
        elif kind == 8:
            out.append([] if i % 20 == 8 else [300])
        else:
            tail = [rng.randrange(256) for _ in range(rng.randrange(1, 10))]
            out.append(rng.choice(prefixes) + tail if kind < 5 else tail * 3)
    return out


def run_mixed(engine: LLMEngine, rng: random.Random, store: Path, batches: int = 10) -> tuple[int, int]:
    """200 requests in batches; truncates the store between batches so some loads fail."""
    ok = failed = 0
    prefixes = [[rng.randrange(256) for _ in range(12)] for _ in range(3)]
    for batch in range(batches):
        outs = engine.generate(mixed_prompts(rng, prefixes, 20), rng.randrange(1, 4))
        ok += sum(o.ok for o in outs)
        failed += sum(not o.ok for o in outs)
        assert engine.block_pool.whole
        if batch % 3 == 1:
            corrupt_store(store)
    return ok, failed


def test_block_pool_is_whole_after_200_mixed_requests(make_container: Make, store_connector: dict[str, Any]) -> None:
    engine = make_container(
        kv_role="kv_both",
        kv_load_failure_policy="fail",
        allocator={"device": "cpu", "block_size": BLOCK_SIZE, "num_blocks": 40},
        scheduler={"max_num_batched_tokens": 32, "max_num_seqs": 6},
        **store_connector,
    ).engine()
    ok, failed = run_mixed(engine, random.Random(0), Path(store_connector["shared_storage"]["path"]))
    assert ok + failed == 200 and ok > 100 and failed > 40
    assert engine.block_pool.whole
    assert engine.connector_stats().total.load_failures > 0


def test_loaded_tokens_never_include_the_last_prompt_token(
    make_container: Make, store_connector: dict[str, Any]
) -> None:
    prompt = list(range(16))  # exactly 4 blocks: the last block must be computed, not loaded
    make_container(kv_role="kv_producer", **store_connector).engine().generate([prompt], 1)
    out = make_container(kv_role="kv_consumer", **store_connector).engine().generate([prompt], 1)[0]
    assert out.num_loaded_tokens == loadable_tokens(16, BLOCK_SIZE) == 12
