"""The two-process prefill/decode pair of ``containers/disagg_pair.py`` over the p2p connector.

Real engine processes on loopback (gloo, CPU), configured by the ``settings/disagg-*.toml``
profiles through ``KVDI_SETTINGS_FILE``. Every wait is bounded; overrunning processes are killed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "containers" / "disagg_pair.py"
PRODUCER_FILE = ROOT / "settings" / "disagg-producer.toml"
CONSUMER_FILE = ROOT / "settings" / "disagg-consumer.toml"
TIMEOUT_S = 3.0
WAIT_S = 90.0
PROMPT = [(7 * i + 3) % 1000 for i in range(40)]  # block size 16: 32 tokens transferable, 8 computed
NEW_TOKENS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def _isolated_env(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVDI_* of the developer reaches the child processes, and no OpenMP spinning on a shared machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_pair_script_decodes_the_single_engine_tokens_computing_only_the_tail() -> None:
    cmd = [sys.executable, str(SCRIPT), "--port", "0", "--json", "--prompts", "1", "--prompt-len", "40"]
    cmd += ["--new-tokens", str(NEW_TOKENS)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_S, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["match"]
    (request,) = report["requests"]
    assert request["output_token_ids"] == request["expected_token_ids"]
    assert request["num_loaded_tokens"] == 32
    assert request["num_computed_prompt_tokens"] == 40 - 32  # only the tokens after the transferred prefix


# -- the producer dies while the consumer's fetch is in flight ------------------------------
def engine_env(settings_file: Path, port: int) -> None:
    os.environ.update(
        {
            "KVDI_SETTINGS_FILE": str(settings_file),
            "KVDI_P2P__KV_PORT": str(port),
            "KVDI_P2P__TIMEOUT_S": str(TIMEOUT_S),
            "KVDI_ALLOCATOR__DEVICE": "cpu",
            "KVDI_ALLOCATOR__NUM_BLOCKS": "32",
        }
    )


def doomed_producer(port: int, out: Any) -> None:
    """Prefill, stop serving, then die (SIGKILL) the moment the consumer's fetch request arrives."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from kvdi.connectors.p2p.protocol import REQUEST_QUEUE
    from kvdi.containers import build_engine_container

    try:
        engine_env(PRODUCER_FILE, port)
        container = build_engine_container()
        container.engine().generate([PROMPT], 1)
        container.kv.backend().stop_serving()  # blocks stay published; nobody answers
        store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=WAIT_S))
        out.put(("prefilled", None))
        out.close()  # flush now: a SIGKILL while the feeder thread holds the queue's write lock
        out.join_thread()  # would block every other writer (the consumer's report) for good
        store.queue_pop(REQUEST_QUEUE)  # the consumer is now waiting for the answer
        os.kill(os.getpid(), signal.SIGKILL)
    except Exception as exc:
        out.put(("producer_error", f"{type(exc).__name__}: {exc}"))


def consumer(port: int, out: Any, go: Any) -> None:
    """Decode PROMPT once the producer prefilled it; then the same prompt on one plain engine."""
    from kvdi.containers import build_engine_container

    try:
        engine_env(CONSUMER_FILE, port)
        container = build_engine_container()
        engine = container.engine()
        received: set[str] = set()  # requests the worker half reported finished receiving: the async path
        inner = engine.worker.connector.get_finished

        def spy(finished: set[str]) -> tuple[set[str] | None, set[str] | None]:
            sending, recving = inner(finished)
            received.update(recving or ())
            return sending, recving

        engine.worker.connector.get_finished = spy  # type: ignore[method-assign]
        go.wait(WAIT_S)
        start = time.monotonic()
        (got,) = engine.generate([PROMPT], NEW_TOKENS)
        elapsed = time.monotonic() - start
        stats = engine.connector_stats().total
        reference = build_engine_container(kv_connector="null", kv_role="kv_both")
        (expected,) = reference.engine().generate([PROMPT], NEW_TOKENS)
        reference.shutdown_resources()
        container.shutdown_resources()
        out.put(
            (
                "decoded",
                {
                    "tokens": list(got.output_token_ids),
                    "expected": list(expected.output_token_ids),
                    "loaded": got.num_loaded_tokens,
                    "computed": got.num_computed_prompt_tokens,
                    "error": got.error,
                    "load_failures": stats.load_failures,
                    "elapsed": elapsed,
                    "received": len(received),
                },
            )
        )
    except Exception as exc:
        out.put(("consumer_error", f"{type(exc).__name__}: {exc}"))


def next_report(out: Any, key: str) -> Any:
    try:
        k, v = out.get(timeout=WAIT_S)
    except Empty:
        pytest.fail(f"no {key!r} report within {WAIT_S}s")
    assert k == key, f"{k}: {v}"
    return v


def test_producer_killed_mid_transfer_the_consumer_recomputes_within_the_timeout() -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    out: Any = ctx.Queue()
    go = ctx.Event()
    prod = ctx.Process(target=doomed_producer, args=(port, out), daemon=True)
    cons = ctx.Process(target=consumer, args=(port, out, go), daemon=True)
    prod.start()
    cons.start()
    try:
        next_report(out, "prefilled")
        go.set()
        decoded = next_report(out, "decoded")
        prod.join(WAIT_S)
        cons.join(WAIT_S)
    finally:
        for proc in (cons, prod):
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert prod.exitcode == -signal.SIGKILL and cons.exitcode == 0
    assert decoded["error"] is None and decoded["tokens"] == decoded["expected"]
    assert decoded["load_failures"] == 1
    assert decoded["received"] == 1  # the load ran asynchronously (transfer.async_load=auto) and ended failed
    assert (decoded["loaded"], decoded["computed"]) == (0, len(PROMPT))  # the transferred prefix was recomputed
    assert decoded["elapsed"] < TIMEOUT_S + 5.0  # bounded by KVDI_P2P__TIMEOUT_S, never a hang
