"""p2p refuses a producer and a consumer of different tensor/pipeline-parallel shapes at pairing, in one line
naming both shapes, with or without an auth token: two real processes pairing over loopback (gloo)."""

from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

pytest.importorskip("torch")

from kvdi.connectors.p2p import handshake as hs
from kvdi.layout import KVCacheSpec

WAIT_S = 60.0
TOKEN = "a-shared-p2p-token-of-some-length"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def layout(tp: int) -> KVCacheSpec:
    tag = f"@tp{tp}pp1.rank0-0" if tp > 1 else ""
    return KVCacheSpec(f"kvdi-test{tag}", num_layers=2, num_kv_heads=2 // tp, head_dim=8, block_size=4, dtype="float32")


def pair_up(role: str, port: int, tp: int, token: str | None, out: Any) -> None:
    """Open the p2p channel as ``role`` with a layout of TP=``tp``; report the error (or that it paired)."""
    from kvdi.connectors.p2p.backend import open_channel
    from kvdi.settings import load_settings

    p2p: dict[str, Any] = {"kv_port": port, "kv_rank": 0 if role == "kv_producer" else 1, "timeout_s": 3.0}
    p2p |= {"connect_timeout_s": 4.0 if role == "kv_producer" else 30.0}
    if token is not None:
        p2p["auth_token"] = token
    try:
        settings = load_settings(kv_connector="p2p", kv_role=role, p2p=p2p, allocator={"device": "cpu"})
        channel = open_channel(settings.p2p, layout(tp), settings)
        channel.close()
        out.put((role, "paired", ""))
    except Exception as exc:
        out.put((role, type(exc).__name__, str(exc)))


def run_pair(producer_tp: int, consumer_tp: int, token: str | None) -> dict[str, tuple[str, str]]:
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=pair_up, args=(role, port, tp, token, out), daemon=True)
        for role, tp in (("kv_producer", producer_tp), ("kv_consumer", consumer_tp))
    ]
    for p in procs:
        p.start()
    reports: dict[str, tuple[str, str]] = {}
    try:
        while len(reports) < 2:
            role, kind, message = out.get(timeout=WAIT_S)
            reports[role] = (kind, message)
    except Empty:
        pytest.fail(f"no report from both sides within {WAIT_S}s (got {reports})")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return reports


@pytest.fixture(autouse=True)
def _isolated_env(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.parametrize("token", [None, TOKEN], ids=["plain", "authenticated"])
def test_a_shape_mismatch_is_refused_at_pairing_naming_both_shapes(token: str | None) -> None:
    reports = run_pair(producer_tp=2, consumer_tp=1, token=token)
    kind, consumer = reports["kv_consumer"]
    assert kind == "P2pHandshakeError" and "\n" not in consumer
    assert "parallel shape differs: this kv_consumer runs TP=1 PP=1, the kv_producer TP=2 PP=1" in consumer
    assert "foreign KV layout" not in consumer  # the shape, the cause, is what the line names
    kind, producer = reports["kv_producer"]
    assert kind == "P2pHandshakeError" and "this kv_producer runs TP=2 PP=1, the kv_consumer TP=1 PP=1" in producer


def test_hellos_carry_the_shape_and_a_peer_without_one_is_one_rank() -> None:
    tp2 = hs.make_hello(rank=0, backend="gloo", layout=layout(2), engine_id="p", auth=True)
    assert tp2["shape"] == [2, 1] and "layout" not in tp2  # the shape is all an authenticating hello adds
    one = hs.make_hello(rank=1, backend="gloo", layout=layout(1), engine_id="c", auth=False)
    old = {k: v for k, v in one.items() if k != "shape"}
    assert hs.parse_hello(hs.json_text(old).encode(), 1)["shape"] == [1, 1]
    for bad in ([0, 1], [1], "2x1", [True, 1]):
        with pytest.raises(ValueError, match="shape must be"):
            hs.parse_hello(hs.json_text({**one, "shape": bad}).encode(), 1)
    assert hs.shape_problem(one, dict(one)) == ""
