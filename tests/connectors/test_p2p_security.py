"""p2p on a hostile network: the store listens only on kv_ip, peers without the auth token are
refused, and bad messages never stop the producer from serving its consumer.

Process tests run a real producer and consumer (gloo on loopback) plus intruder processes, and
write garbage into the producer's real store socket and request queue.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import socket
import time
from datetime import timedelta
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdi.connectors.p2p import handshake as hs
from kvdi.connectors.p2p.protocol import MAX_KEYS, REQUEST_QUEUE, Ack, BadMessage, Request, Session
from kvdi.connectors.p2p.rendezvous import host_store
from kvdi.connectors.store.keys import KEY_BYTES
from kvdi.errors import ConfigError
from tests.helpers.p2p import PROMPT, p2p_settings, poll_until, random_caches, step

TOKEN = "correct horse battery staple"
WAIT_S = 60.0
PRODUCER_BLOCKS = (5, 6, 7, 8)
CONSUMER_BLOCKS = (1, 2, 3, 4)
LOADED = 3
SESSION_KEY = b"k" * 32


@pytest.fixture(autouse=True)
def _isolated_env(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVDI_* of the developer reaches the child processes, and no OpenMP spinning on a shared machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# -- queue messages (one process) ---------------------------------------------------------
NAME = "ab" * KEY_BYTES
GARBAGE: list[bytes] = [
    b"",
    b"\xff\xfe not utf-8",
    b"not json",
    b"[" * 100_000,  # deep nesting: RecursionError inside json
    b"[1, 2, 3]",
    b"null",
    b'"a string"',
    b"{}",
    json.dumps({"seq": "1", "keys": [NAME]}).encode(),
    json.dumps({"seq": True, "keys": [NAME]}).encode(),
    json.dumps({"seq": 1.0, "keys": [NAME]}).encode(),
    json.dumps({"seq": -1, "keys": [NAME]}).encode(),
    json.dumps({"seq": 2**70, "keys": [NAME]}).encode(),
    json.dumps({"seq": 1, "keys": NAME}).encode(),
    json.dumps({"seq": 1, "keys": []}).encode(),
    json.dumps({"seq": 1, "keys": [1, 2]}).encode(),
    json.dumps({"seq": 1, "keys": ["zz" * KEY_BYTES]}).encode(),
    json.dumps({"seq": 1, "keys": ["ab " * (KEY_BYTES - 1) + "abab"]}).encode(),
    json.dumps({"seq": 1, "keys": [NAME[:-2]]}).encode(),
    json.dumps({"seq": 1, "keys": [NAME], "extra": 1}).encode(),
    json.dumps({"ack": None}).encode(),
    json.dumps({"ack": [1]}).encode(),
    json.dumps({"seq": 1, "keys": [NAME] * (MAX_KEYS + 1)}).encode(),
]


@pytest.mark.parametrize("raw", GARBAGE, ids=range(len(GARBAGE)))
def test_a_malformed_message_is_refused_with_a_reason(raw: bytes) -> None:
    with pytest.raises(BadMessage) as info:
        Session(None).decode(raw)
    assert info.value.reason in {"size", "json", "shape", "seq", "keys"}


def test_a_message_that_is_not_bytes_is_refused() -> None:
    with pytest.raises(BadMessage, match="type"):
        Session(None).decode("a str")


def test_messages_round_trip_and_a_replayed_request_is_refused() -> None:
    sender, receiver = Session(SESSION_KEY), Session(SESSION_KEY)
    request = Request(1, (b"\x01" * KEY_BYTES, b"\x02" * KEY_BYTES))
    raw = sender.encode(request).encode()
    assert receiver.decode(raw) == request
    assert receiver.decode(sender.encode(Ack(1)).encode()) == Ack(1)
    with pytest.raises(BadMessage) as info:
        receiver.decode(raw)
    assert info.value.reason == "replay"


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps({"seq": 1, "keys": [NAME]}).encode(),  # well formed, no MAC
        json.dumps({"seq": 1, "keys": [NAME], "mac": "00" * 32}).encode(),  # forged MAC
        Session(b"another key" * 3).encode(Request(1, (bytes(KEY_BYTES),))).encode(),  # another session's MAC
        json.dumps({"ack": 1, "mac": 5}).encode(),
    ],
    ids=["no-mac", "forged-mac", "foreign-session", "mac-not-a-string"],
)
def test_an_authenticated_session_refuses_messages_without_its_mac(raw: bytes) -> None:
    with pytest.raises(BadMessage) as info:
        Session(SESSION_KEY).decode(raw)
    assert info.value.reason == "mac"


def test_block_names_hide_the_block_keys_under_a_session_key() -> None:
    key = bytes(range(KEY_BYTES))
    assert Session(None).name(key) == key
    named = Session(SESSION_KEY).name(key)
    assert len(named) == KEY_BYTES and named != key and named != Session(b"x" * 32).name(key)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_raise_anything_but_bad_message(raw: bytes) -> None:
    for session in (Session(None), Session(SESSION_KEY)):
        try:
            decoded = session.decode(raw)
        except BadMessage:
            continue
        assert not session.authenticated and isinstance(decoded, Request | Ack)  # never without the MAC


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256) | st.recursive(st.none() | st.booleans() | st.integers() | st.text(), st.lists))
def test_a_random_hello_is_a_value_error_or_a_checked_dict(raw: Any) -> None:
    data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    try:
        hello = hs.parse_hello(data, 0)
    except ValueError:
        return
    assert hello["rank"] == 0 and hello["role"] in hs.ROLES  # pragma: no cover - random input never gets here


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[]", b'{"role": "kv_producer", "rank": 0}', b'{"role": "kv_producer", "rank": true}'],
)
def test_a_malformed_hello_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        hs.parse_hello(raw, 0)


def small_layout(block_size: int) -> Any:
    from kvdi.allocator import KVCacheSpec

    return KVCacheSpec("kvdi-test", num_layers=2, num_kv_heads=2, head_dim=8, block_size=block_size, dtype="float32")


def test_proofs_tell_a_wrong_token_from_a_foreign_layout_without_showing_the_peer_layout() -> None:
    mine_layout, peer_layout = small_layout(4), small_layout(8)
    mine = hs.make_hello(rank=0, backend="gloo", layout=mine_layout, engine_id="p", auth=True)
    peer = hs.make_hello(rank=1, backend="gloo", layout=peer_layout, engine_id="c", auth=True)
    assert "layout" not in peer and "fingerprint" not in peer and "engine_id" not in peer
    token = TOKEN.encode()

    def proof(signer_token: bytes, layout: Any) -> bytes:
        return json.dumps(hs.proofs(signer_token, peer, mine, layout.fingerprint())).encode()

    assert hs.auth_problems(mine, peer, proof(token, mine_layout), token, mine_layout) == []
    (wrong,) = hs.auth_problems(mine, peer, proof(b"other", mine_layout), token, mine_layout)
    assert "KVDI_P2P__AUTH_TOKEN differs" in wrong
    (foreign,) = hs.auth_problems(mine, peer, proof(token, peer_layout), token, mine_layout)
    assert "foreign KV layout" in foreign and "block_size=4" in foreign and "block_size=8" not in foreign
    assert hs.session_key(token, mine, peer) == hs.session_key(token, peer, mine)


# -- settings ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KVDI_P2P__TIMEOUT_S", "inf"),
        ("KVDI_P2P__TIMEOUT_S", "nan"),
        ("KVDI_P2P__TIMEOUT_S", "3601"),
        ("KVDI_P2P__CONNECT_TIMEOUT_S", "1e300"),
        ("KVDI_P2P__HOLD_S", "-1"),
        ("KVDI_P2P__KV_PORT", "0"),
        ("KVDI_P2P__KV_PORT", "65536"),
    ],
)
def test_absurd_p2p_settings_are_refused_naming_the_variable(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvdi.settings import load_settings

    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=variable):
        load_settings()


def test_the_auth_token_is_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdi.settings import load_settings

    monkeypatch.setenv("KVDI_P2P__AUTH_TOKEN", TOKEN)
    s = load_settings()
    assert s.p2p.auth_token is not None and s.p2p.auth_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(s) and TOKEN not in str(s.model_dump())


def test_a_short_auth_token_is_refused_without_showing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvdi.containers import build_kv_container

    monkeypatch.setenv("KVDI_P2P__AUTH_TOKEN", "hunter2")
    container = build_kv_container(kv_connector="p2p", kv_role="kv_producer", allocator={"device": "cpu"})
    with pytest.raises(ConfigError, match="KVDI_P2P__AUTH_TOKEN is too short") as info:
        container.backend()
    assert "hunter2" not in str(info.value)


# -- the listening socket --------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listeners(port: int) -> set[str]:
    """Local addresses (hex, as the kernel writes them) listening on TCP ``port``, IPv4 and IPv6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def non_loopback_ipv4() -> str | None:
    """One local IPv4 address that is not loopback, if the host has one."""
    text = Path("/proc/net/fib_trie").read_text() if Path("/proc/net/fib_trie").exists() else ""
    lines = text.splitlines()
    for prev, line in itertools.pairwise(lines):
        if "/32 host LOCAL" in line:
            address = prev.strip().split()[-1]
            if not address.startswith("127."):
                return address
    return None


LOOPBACK_HEX = "0100007F"  # 127.0.0.1 in /proc/net/tcp


def test_a_plain_tcpstore_would_listen_on_every_interface() -> None:
    """What the bound listener fixes (and proof that :func:`listeners` tells the two apart)."""
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=5), wait_for_workers=False)  # type: ignore[attr-defined]
    try:
        assert listeners(port) - {LOOPBACK_HEX}
    finally:
        del store


def test_the_producer_store_listens_on_loopback_only_when_kv_ip_is_loopback() -> None:
    port = free_port()
    store = host_store("127.0.0.1", port, timedelta(seconds=5))
    try:
        assert listeners(port) == {LOOPBACK_HEX}
        other = non_loopback_ipv4()
        if other is not None:  # the same port through another local address: nobody listens there
            with pytest.raises(ConnectionRefusedError), socket.create_connection((other, port), timeout=5):
                pass
        store.set("probe", "1")  # the store still serves on loopback
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        del store


# -- processes -----------------------------------------------------------------------------


def producer(port: int, out: Any, events: dict[str, Any], connect_timeout_s: float = 10.0) -> None:
    """Hold PROMPT's blocks; once the consumer is done, report how many bad messages and peers were refused."""
    from kvdi.containers import build_kv_container

    try:
        container = build_kv_container(p2p_settings("kv_producer", port, TOKEN, connect_timeout_s))
        sched, worker = container.scheduler_connector(), container.worker_connector()
        worker.register_kv_caches(random_caches(container.layout(), seed=1))
        worker.bind_connector_metadata(sched.build_connector_meta(step(PRODUCER_BLOCKS, 0)))
        worker.wait_for_save()
        worker.clear_connector_metadata()
        channel = container.backend()
        out.put(("held", len(channel.held)))
        events["published"].set()
        poll_until(events["consumer_done"].is_set, WAIT_S)
        report = {"rejected": channel.rejected_messages, "refused": channel.refused_peers, "broken": channel.broken}
        out.put(("producer_report", report))
        container.shutdown_resources()
    except Exception as exc:
        out.put(("producer_error", (type(exc).__name__, str(exc))))


def consumer(port: int, out: Any, events: dict[str, Any]) -> None:
    """Pair, wait for the parent's attacks, then look PROMPT up and load it."""
    from kvdi.containers import build_kv_container

    try:
        container = build_kv_container(p2p_settings("kv_consumer", port, TOKEN))
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


def intruder(port: int, token: str | None, out: Any) -> None:
    """A third process that tries to pair with the busy producer as a consumer."""
    from kvdi.containers import build_kv_container

    try:
        container = build_kv_container(p2p_settings("kv_consumer", port, token))
        container.backend()
        out.put(("intruder", ("paired", "")))
    except Exception as exc:
        out.put(("intruder", (type(exc).__name__, str(exc))))


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


def attack_store(port: int) -> int:
    """Raw garbage into the store's socket, then bad messages onto the request queue; how many messages."""
    import torch.distributed as dist

    for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 16):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(junk)
    client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))  # type: ignore[attr-defined]
    forged = [
        json.dumps({"seq": 10**9, "keys": [NAME]}).encode(),  # well formed, no MAC: would make it send
        json.dumps({"seq": 10**9, "keys": [NAME], "mac": "00" * 32}).encode(),
        json.dumps({"ack": 1, "mac": "11" * 32}).encode(),
    ]
    messages = GARBAGE[:-1] + forged  # the oversized one is slow to push through a shared machine
    for raw in messages:
        client.queue_push(REQUEST_QUEUE, raw)
    return len(messages)


def test_intruders_and_garbage_are_refused_and_the_producer_keeps_serving() -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    out: Any = ctx.Queue()
    events = {k: ctx.Event() for k in ("published", "go", "consumer_done")}
    procs = [
        ctx.Process(target=producer, args=(port, out, events), daemon=True),
        ctx.Process(target=consumer, args=(port, out, events), daemon=True),
    ]
    for proc in procs:
        proc.start()
    reports = Reports(out)
    try:
        assert reports.get("held") == LOADED
        reports.get("paired")
        assert listeners(port) == {LOOPBACK_HEX}  # the real producer's store, kv_ip=127.0.0.1
        refusals = {}
        for label, token in (("wrong", "not the right token at all"), ("missing", None)):
            intruder_proc = ctx.Process(target=intruder, args=(port, token, out), daemon=True)
            intruder_proc.start()
            procs.append(intruder_proc)
            refusals[label] = reports.get("intruder")
        sent = attack_store(port)
        events["go"].set()
        loaded = reports.get("loaded")
        producer_report = reports.get("producer_report")
    finally:
        for proc in procs:
            proc.join(WAIT_S if proc.is_alive() else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert refusals["wrong"][0] == "P2pHandshakeError" and "already paired" in refusals["wrong"][1]
    assert refusals["missing"][0] == "P2pHandshakeError" and "requires authentication" in refusals["missing"][1]
    assert TOKEN not in refusals["wrong"][1] + refusals["missing"][1]
    assert loaded == {"matched": LOADED * 4, "errors": [], "same": True}
    assert producer_report == {"rejected": sent, "refused": 0, "broken": None}


def push_bad_hellos(port: int) -> int:
    """Hellos the producer must refuse without ending its wait: garbage, and a producer's hello."""
    import torch.distributed as dist

    from kvdi.connectors.p2p.pairing import HELLO_QUEUE

    client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))  # type: ignore[attr-defined]
    bad = [b"not json", json.dumps({"role": "kv_producer", "rank": 0}).encode()]
    for raw in bad:
        client.queue_push(HELLO_QUEUE, raw)
    return len(bad)


def test_the_producer_refuses_bad_peers_arriving_first_and_pairs_with_the_valid_consumer() -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    out: Any = ctx.Queue()
    events = {k: ctx.Event() for k in ("published", "go", "consumer_done")}
    procs = [ctx.Process(target=producer, args=(port, out, events, 60.0), daemon=True)]
    procs[0].start()
    reports = Reports(out)
    try:
        procs.append(ctx.Process(target=intruder, args=(port, "not the right token at all", out), daemon=True))
        procs[-1].start()
        wrong = reports.get("intruder")  # the producer answered it and refused it
        garbage = push_bad_hellos(port)
        procs.append(ctx.Process(target=consumer, args=(port, out, events), daemon=True))
        procs[-1].start()
        assert reports.get("held") == LOADED
        reports.get("paired")
        events["go"].set()
        loaded = reports.get("loaded")
        producer_report = reports.get("producer_report")
    finally:
        for proc in procs:
            proc.join(WAIT_S if proc.is_alive() else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert wrong[0] == "P2pHandshakeError" and "KVDI_P2P__AUTH_TOKEN differs" in wrong[1] and TOKEN not in wrong[1]
    assert loaded == {"matched": LOADED * 4, "errors": [], "same": True}
    assert producer_report == {"rejected": 0, "refused": 1 + garbage, "broken": None}
