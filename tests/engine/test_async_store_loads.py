"""Asynchronous loads through the store connectors on the reference engine.

With ``transfer.async_load=on`` the scheduler half answers ``load_async=True``: the request
waits (WAITING_FOR_REMOTE_KVS) while the worker half loads in the background, and runs
once ``get_finished`` reports it. Tokens must equal the connector-free engine's; a bad
object is recomputed (``recompute``) or fails only its request (``fail``); other requests
keep running while a load is in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store.keys import block_keys
from kvdi.containers import EngineContainer
from kvdi.engine.engine import LLMEngine
from kvdi.engine.scheduler import Request, RequestStatus
from kvdi.testing.redis_server import RedisServer
from tests.helpers.engine import BLOCK_SIZE

PROMPTS = [[(5 * i + 3 * j) % 256 for j in range(13 + 6 * i)] for i in range(4)]
NEW_TOKENS = 4


@pytest.fixture
def shared_storage(tmp_path: Path) -> dict[str, Any]:
    return {"kv_connector": "shared_storage", "shared_storage": {"path": str(tmp_path / "store")}}


def received_by(engine: LLMEngine) -> set[str]:
    """Request ids the worker half reports as finished receiving (the asynchronous path), from now on."""
    got: set[str] = set()
    worker = engine.worker.connector
    inner = worker.get_finished

    def spy(finished: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = inner(finished)
        got.update(recving or ())
        return sending, recving

    worker.get_finished = spy  # type: ignore[method-assign]
    return got


def stored_then_consumer(
    make: Callable[..., EngineContainer], store: dict[str, Any], **consumer: Any
) -> tuple[EngineContainer, LLMEngine]:
    make(kv_role="kv_producer", **store).engine().generate(PROMPTS, NEW_TOKENS)
    container = make(kv_role="kv_consumer", transfer={"async_load": "on"}, **store, **consumer)
    return container, container.engine()


def flip_last_byte(store: FileBlockStore, prompt: Sequence[int], block: int, container: EngineContainer) -> None:
    path = store.path_for(block_keys(prompt, container.kv.layout())[block])
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("backend", ["shared_storage", pytest.param("redis", marks=pytest.mark.redis)])
def test_async_loads_generate_the_null_connector_tokens(
    backend: str, make_container: Callable[..., EngineContainer], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if backend == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        store: dict[str, Any] = {"kv_connector": "redis", "redis": {"url": server.url}}
    else:
        store = {"kv_connector": "shared_storage", "shared_storage": {"path": str(tmp_path / "store")}}
    expected = make_container().engine().generate(PROMPTS, NEW_TOKENS)
    _, engine = stored_then_consumer(make_container, store)
    received = received_by(engine)
    outs = engine.generate(PROMPTS, NEW_TOKENS)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in expected]
    assert received == {o.request_id for o in outs}  # every load went through the asynchronous path
    assert all(o.num_loaded_tokens == (len(o.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE for o in outs)
    assert engine.connector_stats().worker.loaded_blocks == sum(o.num_loaded_tokens for o in outs) // BLOCK_SIZE
    assert engine.block_pool.whole


def test_a_corrupt_object_under_async_load_is_recomputed(
    make_container: Callable[..., EngineContainer], shared_storage: dict[str, Any]
) -> None:
    expected = make_container().engine().generate(PROMPTS, NEW_TOKENS)
    container, engine = stored_then_consumer(make_container, shared_storage)
    flip_last_byte(container.kv.backend(), PROMPTS[3], 2, container)
    outs = engine.generate(PROMPTS, NEW_TOKENS)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in expected]
    assert outs[3].num_loaded_tokens == 2 * BLOCK_SIZE  # the blocks before the bad one still loaded
    assert engine.connector_stats().worker.corrupt_dropped == 1
    assert engine.block_pool.whole


def test_under_fail_a_corrupt_object_fails_only_its_request(
    make_container: Callable[..., EngineContainer], shared_storage: dict[str, Any]
) -> None:
    expected = make_container().engine().generate(PROMPTS, NEW_TOKENS)
    container, engine = stored_then_consumer(make_container, shared_storage, kv_load_failure_policy="fail")
    flip_last_byte(container.kv.backend(), PROMPTS[1], 0, container)
    outs = engine.generate(PROMPTS, NEW_TOKENS)
    assert outs[1].error is not None and "kv_load_failure_policy=fail" in outs[1].error
    others = [0, 2, 3]
    assert [outs[i].output_token_ids for i in others] == [expected[i].output_token_ids for i in others]
    assert engine.block_pool.whole
    assert engine.generate(PROMPTS[:1], NEW_TOKENS)[0].ok  # and the engine keeps serving


def test_other_requests_run_while_a_load_is_in_flight(
    make_container: Callable[..., EngineContainer], shared_storage: dict[str, Any]
) -> None:
    expected = make_container().engine().generate(PROMPTS, NEW_TOKENS)
    container, engine = stored_then_consumer(make_container, shared_storage)
    store = container.kv.backend()
    gate, entered = threading.Event(), threading.Event()
    inner = store.get_into_many

    def gated(items: Any) -> list[int | None]:
        entered.set()
        gate.wait()
        return inner(items)

    store.get_into_many = gated
    try:
        loading = engine.scheduler.add_request(Request("loading", tuple(PROMPTS[2]), NEW_TOKENS))
        fresh = engine.scheduler.add_request(Request("fresh", tuple(range(40, 51)), NEW_TOKENS))
        while not fresh.finished:
            engine.step()
        # The loader thread may not have reached the store yet on a busy machine: it must, and stay blocked.
        assert entered.wait(10) and loading.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        assert not loading.output_token_ids
    finally:
        gate.set()
    while engine.scheduler.has_unfinished() or engine.scheduler.has_pending_frees():
        engine.step()
    assert tuple(loading.output_token_ids) == expected[2].output_token_ids
    assert loading.num_loaded_tokens > 0 and engine.block_pool.whole
