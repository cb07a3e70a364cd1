"""Asynchronous saves never read a block the engine may have reused: every stored object matches a recompute.

A tiny cache and many requests make the engine hand the same blocks out again and again,
while a slowed store keeps saves in flight for several steps. Each object the connector
stored is then checked against the KV a connector-free engine computes for that prefix
(and its frame checksum must hold), for every store connector; then the same prompts load
back asynchronously under the same churn and generate the same tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvdi.connectors.store import BlockStore
from kvdi.connectors.store.framing import unframe
from kvdi.connectors.store.keys import block_keys
from kvdi.containers import EngineContainer
from kvdi.engine.engine import LLMEngine
from kvdi.engine.model import SequenceChunk
from kvdi.testing.redis_server import RedisServer
from tests.helpers.engine import BLOCK_SIZE

NUM_BLOCKS = 12  # one long request and a short one at a time: blocks are reused every few steps
PROMPTS = [[random.Random(i).randrange(256) for _ in range(9 + (7 * i) % 22)] for i in range(24)]
NEW_TOKENS = 3
WRITE_DELAY_S = 0.004  # per put_many call: saves stay in flight across steps


def slow_writes(store: object, delay_s: float) -> None:
    """Make ``store.put_many`` wait before it writes (the pieces are read only when it runs)."""
    inner = store.put_many  # type: ignore[attr-defined]

    def put_many(items: Sequence[tuple[bytes, Sequence[Any]]]) -> object:
        time.sleep(delay_s)
        return inner(items)

    store.put_many = put_many  # type: ignore[attr-defined]


def tiers(store: object) -> list[BlockStore]:
    """The stores to check: every tier of a ``multi`` store, else the store itself."""
    return [s for _, s in getattr(store, "tiers", [])] or [store]  # type: ignore[list-item]


def connector_settings(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if name == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        return {"kv_connector": "redis", "redis": {"url": server.url}}
    return {"kv_connector": name, "shared_storage": {"path": str(tmp_path / "store")}}


def reference_blocks(container: EngineContainer, prompt: Sequence[int]) -> list[torch.Tensor]:
    """The KV of each full block of ``prompt`` computed alone by a connector-free engine, as bytes per block."""
    engine: LLMEngine = container.engine()
    caches = engine.worker.kv_caches
    n = len(prompt) // BLOCK_SIZE
    engine.worker.model.forward([SequenceChunk(tuple(prompt), 0, list(range(n + 1)))], caches)
    return [torch.cat([caches[name][b].flatten() for name in engine.worker.model.layer_names]) for b in range(n)]


@pytest.mark.parametrize(
    "name",
    [
        "shared_storage",
        "cpu_offload",
        pytest.param("redis", marks=pytest.mark.redis),
        "multi",
    ],
)
def test_every_object_stored_under_block_reuse_matches_a_recompute(
    name: str, tmp_path: Path, request: pytest.FixtureRequest, make_container: Callable[..., EngineContainer]
) -> None:
    settings = connector_settings(name, tmp_path, request)
    alloc = {"device": "cpu", "block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS}
    producer = make_container(allocator=alloc, transfer={"async_save": True, "async_load": "on"}, **settings)
    store = producer.kv.backend()
    slow_writes(store, WRITE_DELAY_S)
    engine: LLMEngine = producer.engine()
    outputs = engine.generate(PROMPTS, NEW_TOKENS)
    assert all(o.ok for o in outputs)
    assert engine.block_pool.whole  # every held block came back once its saves were written
    stats = engine.connector_stats().worker
    assert stats.save_failures == 0 and stats.saved_blocks == sum(
        len(p) // BLOCK_SIZE for p in {tuple(p) for p in PROMPTS}
    )

    reference = make_container(
        kv_connector="null", allocator={"device": "cpu", "block_size": BLOCK_SIZE, "num_blocks": 16}
    )
    layout = producer.kv.layout()
    fingerprint, checked = layout.fingerprint(), 0
    for prompt in PROMPTS:
        keys = block_keys(prompt, layout)
        expected = reference_blocks(reference, prompt)
        for tier in tiers(store):
            for want, obj, key in zip(expected, tier.get_many(keys), keys, strict=True):
                assert obj is not None
                payload = unframe(
                    obj, fingerprint, layout.block_bytes, name=key
                )  # raises if the checksum does not hold
                got = torch.frombuffer(bytearray(payload), dtype=want.dtype)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
                checked += 1
    assert checked >= len(PROMPTS)

    again = engine.generate(PROMPTS, NEW_TOKENS)  # now every prefix loads in the background, blocks still reused
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in outputs]
    assert all(o.num_loaded_tokens > 0 for o in again) and engine.block_pool.whole
