"""p2p pairing under attack, with real processes (gloo on loopback) and the producer's real store.

- A peer without the token that takes the producer's place (pops the consumer's hello and
  answers ``ok``) cannot pair with a consumer that has a token: the consumer needs the
  producer's proof and a MACed ``ok``.
- Without a token (the default), a well-formed request with an absurd sequence number is
  dropped and counted; the channel keeps serving its consumer.
- Hellos that never send a proof do not delay a valid consumer: the producer answers them
  concurrently, each for at most ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import secrets
import threading
import time
from datetime import timedelta
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
import torch

from kvdi.connectors.store.keys import KEY_BYTES
from tests.helpers.p2p import PROMPT, TIMEOUT_S, p2p_settings, poll_until, random_caches, step

TOKEN = "correct horse battery staple"
WAIT_S = 90.0
PRODUCER_BLOCKS = (5, 6, 7, 8)
CONSUMER_BLOCKS = (1, 2, 3, 4)
LOADED = 3


@pytest.fixture(autouse=True)
def _isolated_env(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVDI_* of the developer reaches the child processes, and no OpenMP spinning on a shared machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def free_port() -> int:
    from kvdi.testing.redis_server import free_port as free

    return free()


def producer(port: int, token: str | None, out: Any, events: dict[str, Any], connect_timeout_s: float) -> None:
    """Hold PROMPT's blocks; once the consumer is done, report what the producer refused and whether it broke."""
    from kvdi.containers import build_kv_container

    try:
        container = build_kv_container(p2p_settings("kv_producer", port, token, connect_timeout_s))
        sched, worker = container.scheduler_connector(), container.worker_connector()
        worker.register_kv_caches(random_caches(container.layout(), seed=1))
        worker.bind_connector_metadata(sched.build_connector_meta(step(PRODUCER_BLOCKS, 0)))
        worker.wait_for_save()
        worker.clear_connector_metadata()
        channel = container.backend()
        out.put(("held", len(channel.held)))
        poll_until(events["consumer_done"].is_set, WAIT_S)
        report = {"rejected": channel.rejected_messages, "refused": channel.refused_peers, "broken": channel.broken}
        out.put(("producer_report", report))
        container.shutdown_resources()
    except Exception as exc:
        out.put(("producer_error", (type(exc).__name__, str(exc))))


def consumer(port: int, token: str | None, out: Any, events: dict[str, Any], connect_timeout_s: float) -> None:
    """Pair, wait for the parent's go, then look PROMPT up and load it."""
    from kvdi.containers import build_kv_container

    try:
        container = build_kv_container(p2p_settings("kv_consumer", port, token, connect_timeout_s))
        sched, worker = container.scheduler_connector(), container.worker_connector()
        caches = random_caches(container.layout(), seed=2)
        worker.register_kv_caches(caches)
        out.put(("paired", None))
        poll_until(events["go"].is_set, WAIT_S)
        matched, _ = sched.get_num_new_matched_tokens(PROMPT, 0)
        sched.update_state_after_alloc(PROMPT, CONSUMER_BLOCKS, matched)
        worker.bind_connector_metadata(sched.build_connector_meta(step(CONSUMER_BLOCKS, matched)))
        worker.start_load_kv()
        errors = sorted(worker.get_block_ids_with_load_errors())
        worker.clear_connector_metadata()
        expected = random_caches(container.layout(), seed=1)
        same = all(
            torch.equal(caches[n][list(CONSUMER_BLOCKS[:LOADED])], expected[n][list(PRODUCER_BLOCKS[:LOADED])])
            for n in caches
        )
        out.put(("loaded", {"matched": matched, "errors": errors, "same": same}))
        events["consumer_done"].set()
        container.shutdown_resources()
    except Exception as exc:
        out.put(("consumer_error", (type(exc).__name__, str(exc))))


def pair_only(port: int, token: str | None, out: Any, connect_timeout_s: float) -> None:
    """A consumer that only pairs: reports ``paired`` or the error that ended its pairing."""
    from kvdi.containers import build_kv_container

    try:
        container = build_kv_container(p2p_settings("kv_consumer", port, token, connect_timeout_s))
        container.backend()
        out.put(("pairing", ("paired", "")))
    except Exception as exc:
        out.put(("pairing", (type(exc).__name__, str(exc))))


class Reports:
    def __init__(self, out: Any) -> None:
        self.out = out
        self.seen: dict[str, Any] = {}

    def get(self, key: str, timeout_s: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while key not in self.seen:
            try:
                k, v = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
            except Empty:
                pytest.fail(f"no {key!r} report within {timeout_s}s (got {sorted(self.seen)})")
            if k.endswith("_error"):
                pytest.fail(f"{k}: {v}")
            self.seen[k] = v
        return self.seen.pop(key)


def stop(procs: list[Any]) -> None:
    for proc in procs:
        proc.join(WAIT_S if proc.is_alive() else 0)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def client(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))  # type: ignore[attr-defined]


# -- a peer without the token in the producer's place ----------------------------------------------


def test_a_peer_without_the_token_cannot_answer_ok_in_the_producers_place() -> None:
    """The hijacker hosts the store, announces itself as an authenticating producer, pops the consumer's
    hello, answers ``ok`` and joins the process group as rank 0. The consumer must not pair with it."""
    import torch.distributed as dist

    from kvdi.connectors.p2p import handshake as hs
    from kvdi.connectors.p2p.pairing import PRODUCER_HELLO, pop_hello, verdict_key
    from kvdi.connectors.p2p.protocol import PREFIX
    from kvdi.connectors.p2p.rendezvous import host_store
    from kvdi.layout import KVCacheSpec

    ctx = mp.get_context("spawn")
    port = free_port()
    store = host_store("127.0.0.1", port, timedelta(seconds=10))
    layout = KVCacheSpec("any", 2, 2, 8, 4, "float32")
    store.set(
        PRODUCER_HELLO, hs.json_text(hs.make_hello(rank=0, backend="gloo", layout=layout, engine_id="x", auth=True))
    )
    out: Any = ctx.Queue()
    proc = ctx.Process(target=pair_only, args=(port, TOKEN, out, 6.0), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + WAIT_S
        raw = None
        while raw is None and time.monotonic() < deadline:
            raw = pop_hello(store)
            time.sleep(0.02)
        assert raw is not None, "the consumer never announced itself"
        nonce = hs.parse_hello(raw, 1)["nonce"]
        for _ in range(3):  # answer "ok" (again after the consumer drops it), with no proof and no MAC
            store.set(verdict_key(nonce), "ok")
            time.sleep(0.3)

        def join_group() -> None:  # what completes the consumer's process group if it trusts the "ok"
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timedelta(seconds=8)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            with contextlib.suppress(RuntimeError):
                dist.ProcessGroupGloo(dist.PrefixStore(PREFIX + "pg", store), 0, 2, options)  # type: ignore[attr-defined]

        threading.Thread(target=join_group, daemon=True).start()
        outcome, message = Reports(out).get("pairing")
    finally:
        stop([proc])
    assert outcome == "P2pHandshakeError", message
    assert "proof" in message and TOKEN not in message


# -- without a token: absurd requests are dropped, the channel keeps serving -----------------------


def forged_requests() -> list[bytes]:
    name = "ab" * KEY_BYTES
    return [
        json.dumps({"seq": 10**9, "keys": [name]}).encode(),  # well formed, unsigned, absurd sequence number
        json.dumps({"seq": 2**61, "keys": [name] * 64}).encode(),
        json.dumps({"seq": 2, "keys": [name]}).encode(),  # not the next fetch either (the next is 1)
    ]


def test_without_a_token_an_absurd_request_is_dropped_and_the_channel_keeps_serving() -> None:
    from kvdi.connectors.p2p.protocol import REQUEST_QUEUE

    ctx = mp.get_context("spawn")
    port = free_port()
    out: Any = ctx.Queue()
    events = {k: ctx.Event() for k in ("go", "consumer_done")}
    procs = [
        ctx.Process(target=producer, args=(port, None, out, events, 30.0), daemon=True),
        ctx.Process(target=consumer, args=(port, None, out, events, 30.0), daemon=True),
    ]
    for proc in procs:
        proc.start()
    reports = Reports(out)
    try:
        assert reports.get("held") == LOADED
        reports.get("paired")
        attacker = client(port)
        forged = forged_requests()
        for raw in forged:
            attacker.queue_push(REQUEST_QUEUE, raw)
        time.sleep(TIMEOUT_S + 1.0)  # long enough for a producer that answered one to time out sending it
        events["go"].set()
        loaded = reports.get("loaded")
        producer_report = reports.get("producer_report")
    finally:
        stop(procs)
    assert loaded == {"matched": LOADED * 4, "errors": [], "same": True}
    assert producer_report == {"rejected": len(forged), "refused": 0, "broken": None}


# -- hellos that never prove anything do not stall the pairing --------------------------------------


def bogus_hellos(count: int) -> list[str]:
    """Valid-looking hellos of authenticating consumers that will never send a proof."""
    hello = {"role": "kv_consumer", "rank": 1, "backend": "gloo", "auth": True}
    return [json.dumps(hello | {"nonce": secrets.token_hex(32)}) for _ in range(count)]


def test_hellos_without_a_proof_do_not_delay_a_valid_consumer() -> None:
    """Ten silent peers queue before the real consumer. Answered one at a time, each would hold the producer
    for ``timeout_s`` (30 s in all, past the consumer's 10 s ``connect_timeout_s``); answered together,
    the consumer pairs and loads."""
    from kvdi.connectors.p2p.pairing import HELLO_QUEUE, PRODUCER_HELLO

    ctx = mp.get_context("spawn")
    port = free_port()
    out: Any = ctx.Queue()
    events = {k: ctx.Event() for k in ("go", "consumer_done")}
    procs = [ctx.Process(target=producer, args=(port, TOKEN, out, events, 60.0), daemon=True)]
    procs[0].start()
    reports = Reports(out)
    try:
        attacker = client(port)
        attacker.wait([PRODUCER_HELLO], timedelta(seconds=WAIT_S))
        for raw in bogus_hellos(10):
            attacker.queue_push(HELLO_QUEUE, raw)
        procs.append(ctx.Process(target=consumer, args=(port, TOKEN, out, events, 10.0), daemon=True))
        procs[-1].start()
        assert reports.get("held") == LOADED
        reports.get("paired")
        events["go"].set()
        loaded = reports.get("loaded")
        producer_report = reports.get("producer_report")
    finally:
        stop(procs)
    assert loaded == {"matched": LOADED * 4, "errors": [], "same": True}
    assert producer_report["broken"] is None and producer_report["rejected"] == 0


# -- a token is required off loopback --------------------------------------------------------------


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_pair_reachable_from_the_network_needs_a_token(role: str) -> None:
    """kv_ip 192.0.2.1 (a documentation address, nothing answers there): refused before any socket."""
    from kvdi.containers import build_kv_container
    from kvdi.errors import ConfigError
    from kvdi.settings import load_settings

    p2p = {"kv_ip": "192.0.2.1", "kv_port": free_port(), "kv_rank": 0 if role == "kv_producer" else 1}
    settings = load_settings(
        kv_connector="p2p",
        kv_role=role,
        p2p=p2p | {"connect_timeout_s": 30.0},
        model={"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "hidden_size": 32},
        allocator={"device": "cpu", "num_blocks": 16, "block_size": 4},
    )
    container = build_kv_container(settings)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        container.backend()
    assert time.monotonic() - started < 10.0  # refused up front, not after a connect timeout
    message = str(info.value)
    assert "KVDI_P2P__KV_IP='192.0.2.1'" in message and "KVDI_P2P__AUTH_TOKEN" in message


@pytest.mark.parametrize(
    ("kv_ip", "token", "refused"),
    [("127.0.0.1", False, False), ("localhost", False, False), ("::1", False, False), ("10.1.2.3", True, False),
     ("10.1.2.3", False, True), ("0.0.0.0", False, True), ("x" * 300, False, True)],
)  # fmt: skip
def test_require_token(kv_ip: str, token: bool, refused: bool) -> None:
    from kvdi.connectors.p2p.rendezvous import require_token
    from kvdi.errors import ConfigError

    if not refused:
        require_token(kv_ip, token)
        return
    with pytest.raises(ConfigError, match="KVDI_P2P__AUTH_TOKEN") as info:
        require_token(kv_ip, token)
    assert len(str(info.value)) < 400  # a long kv_ip is cut, not echoed whole
