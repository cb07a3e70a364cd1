"""A prefill engine and a decode engine in two real processes over the ``p2p`` connector (gloo, loopback).

Each test starts a producer process that prefills prompts (one token each, its KV held for the
consumer) and a consumer process that decodes them and compares with one connector-free
engine. Covered: the integrity key on p2p frames, asynchronous loads (the request waits in
WAITING_FOR_REMOTE_KVS while other requests run, and the worker half reports it finished
receiving), and block reuse on both sides (tiny caches, many requests: every block the
consumer received equals the KV a connector-free engine computes for that prefix). Every wait
is bounded; processes that overrun are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCER_FILE = ROOT / "settings" / "disagg-producer.toml"
CONSUMER_FILE = ROOT / "settings" / "disagg-consumer.toml"
TIMEOUT_S = 5.0
WAIT_S = 90.0
NEW_TOKENS = 3
PROMPT = [(7 * i + 3) % 1000 for i in range(40)]  # block size 16: 2 blocks transferable, 8 tokens computed
KEY = "an integrity key of the pair, 32b"
OTHER_KEY = "another integrity key, not theirs"
REUSE_BLOCKS = 12  # block size 4: one long request and a short one at a time, on both sides
REUSE_PROMPTS = [[random.Random(i).randrange(1000) for _ in range(9 + (7 * i) % 22)] for i in range(24)]

Env = dict[str, str]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def _isolated_env(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVDI_* of the developer reaches the child processes, and no OpenMP spinning on a shared machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def use_env(settings_file: Path, port: int, env: Env) -> None:
    os.environ.update(
        {
            "KVDI_SETTINGS_FILE": str(settings_file),
            "KVDI_P2P__KV_PORT": str(port),
            "KVDI_P2P__TIMEOUT_S": str(TIMEOUT_S),
            "KVDI_ALLOCATOR__DEVICE": "cpu",
            "KVDI_ALLOCATOR__NUM_BLOCKS": "32",
            **env,
        }
    )


def poll_until(ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.02)


# -- the two processes --------------------------------------------------------------------------
def producer(port: int, env: Env, prompts: list[list[int]], out: Any, done: Any) -> None:
    """Prefill ``prompts`` (one token each), say so, and keep serving until ``done``."""
    from kvdi.containers import build_engine_container

    try:
        use_env(PRODUCER_FILE, port, env)
        container = build_engine_container()
        outputs = container.engine().generate(prompts, 1)
        out.put(("prefilled", [o.error for o in outputs]))
        poll_until(done.is_set, WAIT_S)
        container.shutdown_resources()
    except Exception as exc:
        out.put(("producer_error", f"{type(exc).__name__}: {exc}"))


def consumer(port: int, env: Env, prompts: list[list[int]], scenario: str, out: Any, go: Any) -> None:
    """Decode ``prompts`` once they are prefilled (``scenario`` says how); report tokens, stats, the async path."""
    from kvdi.containers import build_engine_container

    try:
        use_env(CONSUMER_FILE, port, env)
        container = build_engine_container()
        engine = container.engine()
        received = spy_received(engine)
        fetched = spy_fetched(engine)
        poll_until(go.is_set, WAIT_S)
        start = time.monotonic()
        report = SCENARIOS[scenario](container, engine, prompts)
        report["elapsed"] = time.monotonic() - start
        stats = engine.connector_stats().total
        report |= {"stats": stats.as_dict(), "received": len(received), "pool_whole": engine.block_pool.whole}
        engine.shutdown()
        container.shutdown_resources()
        reference = build_engine_container(kv_connector="null", kv_role="kv_both")
        ref_engine = reference.engine()
        report["expected"] = [list(o.output_token_ids) for o in ref_engine.generate(prompts, NEW_TOKENS)]
        report["kv_mismatches"], report["kv_checked"] = check_fetched(ref_engine, prompts, fetched)
        reference.shutdown_resources()
        out.put(("decoded", report))
    except Exception as exc:
        out.put(("consumer_error", f"{type(exc).__name__}: {exc}"))


def spy_received(engine: Any) -> set[str]:
    """Request ids the worker half reports as finished receiving (the asynchronous path)."""
    got: set[str] = set()
    worker = engine.worker.connector
    inner = worker.get_finished

    def spy(finished: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = inner(finished)
        got.update(recving or ())
        return sending, recving

    worker.get_finished = spy
    return got


def spy_fetched(engine: Any) -> dict[bytes, Any]:
    """The bytes of every block the consumer received intact, by block key, copied as it arrived."""
    import torch

    got: dict[bytes, Any] = {}
    worker = engine.worker.connector
    inner = worker._fetch

    def spy(receiver: Any, keys: Sequence[bytes], ids: Sequence[int], stats: Any) -> list[bool]:
        good: list[bool] = inner(receiver, keys, ids, stats)
        for key, block, ok in zip(keys, ids, good, strict=True):
            if ok:
                got[key] = torch.cat([c[block].flatten() for c in receiver.caches]).clone()
        return good

    worker._fetch = spy
    return got


def check_fetched(ref_engine: Any, prompts: Sequence[Sequence[int]], fetched: dict[bytes, Any]) -> tuple[int, int]:
    """Compare each fetched block with the KV a connector-free engine computes for its prefix alone."""
    import torch

    from kvdi.connectors.store.keys import block_keys
    from kvdi.engine.model import SequenceChunk

    if not fetched:
        return 0, 0
    worker = ref_engine.worker
    caches, names, bs = worker.kv_caches, worker.model.layer_names, worker.block_size
    layout = ref_engine.scheduler.connector.context.layout
    mismatches = checked = 0
    for prompt in prompts:
        n = len(prompt) // bs
        worker.model.forward([SequenceChunk(tuple(prompt), 0, list(range(n + 1)))], caches)
        for b, key in enumerate(block_keys(prompt, layout)[:n]):
            if key in fetched:
                want = torch.cat([caches[name][b].flatten() for name in names])
                checked += 1
                mismatches += not torch.allclose(fetched[key], want, atol=1e-4, rtol=0)
    return mismatches, checked


# -- what the consumer does ---------------------------------------------------------------------
def generate(container: Any, engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    outputs = engine.generate(prompts, NEW_TOKENS)
    return {
        "tokens": [list(o.output_token_ids) for o in outputs],
        "loaded": [o.num_loaded_tokens for o in outputs],
        "errors": [o.error for o in outputs],
    }


def in_flight(container: Any, engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Hold the fetch of prompts[0] back until a fresh request (prompts[1], not prefilled) finished."""
    from kvdi.engine.scheduler import Request

    channel = container.kv.backend()
    gate, entered = threading.Event(), threading.Event()
    inner = channel.request

    def gated(keys: Sequence[bytes]) -> Any:
        entered.set()
        gate.wait(WAIT_S)
        return inner(keys)

    channel.request = gated
    loading = engine.scheduler.add_request(Request("loading", tuple(prompts[0]), NEW_TOKENS))
    fresh = engine.scheduler.add_request(Request("fresh", tuple(prompts[1]), NEW_TOKENS))
    steps = 0
    while not fresh.finished and steps < 1000:
        engine.step()
        steps += 1
    seen = {"fetch_started": entered.is_set(), "status": loading.status.name, "tokens": len(loading.output_token_ids)}
    gate.set()
    deadline = time.monotonic() + WAIT_S
    while (engine.scheduler.has_unfinished() or engine.scheduler.has_pending_frees()) and time.monotonic() < deadline:
        engine.step()
    return {
        "while_fetching": seen,
        "tokens": [list(loading.output_token_ids), list(fresh.output_token_ids)],
        "loaded": [loading.num_loaded_tokens, fresh.num_loaded_tokens],
        "errors": [loading.error, fresh.error],
    }


def abort_in_flight(container: Any, engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Fail the request of prompts[0] while its fetch is held back: its blocks must stay taken until the fetch ended."""
    channel = container.kv.backend()
    gate, entered = threading.Event(), threading.Event()
    inner = channel.request

    def gated(keys: Sequence[bytes]) -> Any:
        entered.set()
        gate.wait(WAIT_S)
        return inner(keys)

    channel.request = gated
    from kvdi.engine.scheduler import Request

    loading = engine.scheduler.add_request(Request("loading", tuple(prompts[0]), NEW_TOKENS))
    engine.step()
    poll_until(entered.is_set, WAIT_S)
    engine.scheduler.fail_requests(["loading"], "aborted by the test")
    for _ in range(5):  # the fetch is still held back: the blocks must not come back
        engine.step()
    held = {"pending_frees": engine.scheduler.has_pending_frees(), "pool_whole": engine.block_pool.whole}
    gate.set()
    deadline = time.monotonic() + WAIT_S
    while engine.scheduler.has_pending_frees() and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    after = generate(container, engine, prompts[1:])
    return {
        "while_fetching": held,
        "tokens": [list(loading.output_token_ids), *after["tokens"]],
        "loaded": [loading.num_loaded_tokens, *after["loaded"]],
        "errors": [loading.error, *after["errors"]],
    }


def then_serve(container: Any, engine: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Generate ``prompts[:1]`` (loaded), then ``prompts[1:]`` (not prefilled): does the engine keep serving?"""
    first, rest = generate(container, engine, prompts[:1]), generate(container, engine, prompts[1:])
    return {k: first[k] + rest[k] for k in first}


SCENARIOS: dict[str, Callable[[Any, Any, list[list[int]]], dict[str, Any]]] = {
    "generate": generate,
    "in_flight": in_flight,
    "then_serve": then_serve,
    "abort_in_flight": abort_in_flight,
}


@contextmanager
def running_pair(
    prompts: list[list[int]], prefill: list[list[int]], scenario: str, producer_env: Env, consumer_env: Env
) -> Iterator[Callable[[str], Any]]:
    """Start both processes; yields ``report(key)``. The producer prefills ``prefill``."""
    ctx = mp.get_context("spawn")
    port = free_port()
    out: Any = ctx.Queue()
    go, done = ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(target=producer, args=(port, producer_env, prefill, out, done), daemon=True),
        ctx.Process(target=consumer, args=(port, consumer_env, prompts, scenario, out, go), daemon=True),
    ]
    for proc in procs:
        proc.start()
    seen: dict[str, Any] = {}

    def report(key: str) -> Any:
        deadline = time.monotonic() + WAIT_S
        while key not in seen:
            try:
                k, v = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except Empty:
                pytest.fail(f"no {key!r} report within {WAIT_S}s (got {sorted(seen)})")
            if k.endswith("_error"):
                pytest.fail(f"{k}: {v}")
            seen[k] = v
        return seen[key]

    try:
        assert report("prefilled") == [None] * len(prefill)
        go.set()
        yield report
    finally:
        done.set()
        for proc in procs:
            proc.join(WAIT_S if proc.is_alive() else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def decode(
    prompts: list[list[int]],
    *,
    scenario: str = "generate",
    prefill: list[list[int]] | None = None,
    producer_env: Env | None = None,
    consumer_env: Env | None = None,
) -> dict[str, Any]:
    with running_pair(prompts, prefill or prompts, scenario, producer_env or {}, consumer_env or {}) as report:
        decoded: dict[str, Any] = report("decoded")
    return decoded


# -- A: the integrity key -------------------------------------------------------------------------
def test_keyed_frames_load_when_both_engines_share_the_key() -> None:
    got = decode([PROMPT], producer_env={"KVDI_INTEGRITY_KEY": KEY}, consumer_env={"KVDI_INTEGRITY_KEY": KEY})
    assert got["errors"] == [None] and got["tokens"] == got["expected"]
    assert got["loaded"] == [32] and got["stats"]["corrupt_dropped"] == 0


@pytest.mark.parametrize("producer_key", [None, OTHER_KEY], ids=["producer-unkeyed", "producer-other-key"])
def test_frames_without_the_consumers_key_are_counted_misses_and_recomputed(producer_key: str | None) -> None:
    producer_env = {} if producer_key is None else {"KVDI_INTEGRITY_KEY": producer_key}
    got = decode([PROMPT], producer_env=producer_env, consumer_env={"KVDI_INTEGRITY_KEY": KEY})
    assert got["errors"] == [None] and got["tokens"] == got["expected"]
    assert got["loaded"] == [0]  # both blocks recomputed
    assert got["stats"]["corrupt_dropped"] == 2 and got["stats"]["loaded_blocks"] == 0
    assert got["kv_checked"] == 0


# -- C: asynchronous loads ------------------------------------------------------------------------
def test_async_loads_decode_the_single_engine_tokens_through_the_async_path() -> None:
    prompts = [PROMPT, [(11 * i + 5) % 1000 for i in range(56)]]
    got = decode(prompts)  # transfer.async_load=auto: p2p loads asynchronously
    assert got["errors"] == [None, None] and got["tokens"] == got["expected"]
    assert got["loaded"] == [32, 48]
    assert got["received"] == 2  # the worker half reported both as finished receiving
    assert got["pool_whole"] and got["kv_mismatches"] == 0 and got["kv_checked"] == 5


def test_async_load_off_loads_synchronously_with_the_same_tokens() -> None:
    got = decode([PROMPT], consumer_env={"KVDI_TRANSFER__ASYNC_LOAD": "off"})
    assert got["errors"] == [None] and got["tokens"] == got["expected"] and got["loaded"] == [32]
    assert got["received"] == 0  # nothing went through get_finished


def test_other_requests_run_while_a_fetch_is_in_flight() -> None:
    fresh = [(13 * i + 1) % 1000 for i in range(21)]
    got = decode([PROMPT, fresh], scenario="in_flight", prefill=[PROMPT])
    assert got["while_fetching"] == {"fetch_started": True, "status": "WAITING_FOR_REMOTE_KVS", "tokens": 0}
    assert got["errors"] == [None, None] and got["tokens"] == got["expected"]
    assert got["loaded"] == [32, 0] and got["received"] == 1


def test_under_policy_fail_a_failed_async_load_fails_its_request_and_the_engine_keeps_serving() -> None:
    fresh = [(13 * i + 1) % 1000 for i in range(21)]
    consumer_env = {"KVDI_INTEGRITY_KEY": KEY, "KVDI_KV_LOAD_FAILURE_POLICY": "fail"}
    got = decode([PROMPT, fresh], scenario="then_serve", prefill=[PROMPT], consumer_env=consumer_env)
    assert got["errors"][0] is not None and "kv_load_failure_policy=fail" in got["errors"][0]
    assert got["errors"][1] is None and got["tokens"][1] == got["expected"][1]
    assert got["stats"]["corrupt_dropped"] == 2 and got["received"] == 1 and got["pool_whole"]


def test_a_request_finished_while_its_fetch_runs_keeps_its_blocks_until_the_fetch_ended() -> None:
    fresh = [(13 * i + 1) % 1000 for i in range(21)]
    got = decode([PROMPT, fresh], scenario="abort_in_flight", prefill=[PROMPT])
    assert got["while_fetching"] == {"pending_frees": True, "pool_whole": False}  # delay_free held them
    assert got["errors"] == ["aborted by the test", None] and got["tokens"][1] == got["expected"][1]
    assert got["pool_whole"]  # given back once the worker half reported the fetch over


# -- D: block reuse on both sides -----------------------------------------------------------------
def test_every_block_received_under_block_reuse_matches_a_recompute() -> None:
    """Tiny caches on both sides: the producer's blocks are reused many times before the consumer fetches
    them (its frames were copied out at save time), and the consumer's fetches land in blocks other
    requests just gave back. Every received block equals a recompute; the tokens equal one engine's."""
    tiny = {"KVDI_ALLOCATOR__BLOCK_SIZE": "4", "KVDI_ALLOCATOR__NUM_BLOCKS": str(REUSE_BLOCKS)}
    got = decode(REUSE_PROMPTS, producer_env=tiny, consumer_env=tiny)
    assert got["errors"] == [None] * len(REUSE_PROMPTS) and got["tokens"] == got["expected"]
    loadable = [(len(p) - 1) // 4 for p in REUSE_PROMPTS]
    assert got["loaded"] == [4 * n for n in loadable]
    assert got["kv_checked"] == sum(loadable) and got["kv_mismatches"] == 0
    assert got["received"] == len(REUSE_PROMPTS) and got["pool_whole"]
