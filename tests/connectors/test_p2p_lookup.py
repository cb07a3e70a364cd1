"""kvdi.connectors.p2p.lookup: what a p2p scheduler half in a process of its own looks blocks up in.

Against a real rendezvous store (``TCPStore`` on a free loopback port): the lookup side pairs
nothing, finds the session the consumer's worker paired from the announced hellos, and counts
the published prefix under that session's block names.
"""

from __future__ import annotations

import secrets
import socket
import time
from datetime import timedelta
from typing import Any

import pytest

from kvdi.connectors.p2p import handshake as hs
from kvdi.connectors.p2p.lookup import PAIRED_KEY, LookupChannel, session_from_hellos
from kvdi.connectors.p2p.protocol import Session
from kvdi.layout import KVCacheSpec
from kvdi.settings import load_settings

LAYOUT = KVCacheSpec("m", 2, 2, 8, 4, "float32")
TOKEN = secrets.token_urlsafe(24)
KEYS = [bytes([i]) * 16 for i in range(1, 5)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hellos(auth: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    make = hs.make_hello
    return (
        make(rank=0, backend="gloo", layout=LAYOUT, engine_id="p", auth=auth),
        make(rank=1, backend="gloo", layout=LAYOUT, engine_id="c", auth=auth),
    )


def lookups(port: int, role: str = "kv_consumer", token: str | None = TOKEN, timeout_s: float = 2.0) -> LookupChannel:
    p2p: dict[str, Any] = {"kv_port": port, "kv_rank": 0 if role == "kv_producer" else 1, "timeout_s": timeout_s}
    if token is not None:
        p2p["auth_token"] = token
    settings = load_settings(kv_connector="p2p", kv_role=role, p2p=p2p, allocator={"device": "cpu"})
    return LookupChannel(settings.p2p, LAYOUT, settings)


def test_the_lookup_session_names_blocks_as_both_paired_peers_do() -> None:
    producer, consumer = hellos(auth=True)
    session = session_from_hellos(TOKEN.encode(), hs.json_text(producer).encode(), hs.json_text(consumer).encode())
    as_consumer = Session(hs.session_key(TOKEN.encode(), consumer, producer))
    as_producer = Session(hs.session_key(TOKEN.encode(), producer, consumer))
    assert [session.name(k) for k in KEYS] == [as_consumer.name(k) for k in KEYS] == [as_producer.name(k) for k in KEYS]
    other = session_from_hellos(b"another token of 24 chars", *(hs.json_text(h).encode() for h in (producer, consumer)))
    assert other.name(KEYS[0]) != session.name(KEYS[0])  # a wrong token only misses


def test_a_pair_announced_without_a_token_is_refused_by_a_side_with_one() -> None:
    producer, consumer = hellos(auth=False)
    with pytest.raises(ValueError, match="authenticates differently"):
        session_from_hellos(TOKEN.encode(), hs.json_text(producer).encode(), hs.json_text(consumer).encode())
    assert (
        session_from_hellos(None, hs.json_text(producer).encode(), hs.json_text(consumer).encode()).name(KEYS[0])
        == KEYS[0]
    )


def test_a_producers_lookups_open_nothing() -> None:
    """The producer's scheduler half only plans saves: no store is reached (nothing listens on the port)."""
    side = lookups(free_port(), role="kv_producer")
    assert side.producer and side.count_published(KEYS) == 0 and side.broken is None


def test_lookups_wait_for_the_announced_pairing_then_count_the_published_prefix() -> None:
    from kvdi.connectors.p2p.rendezvous import host_store

    port = free_port()
    store = host_store("127.0.0.1", port, timedelta(seconds=10))
    side = lookups(port, timeout_s=30.0)  # a busy CI host once took over 2 s for a store call: broken, so 0
    assert side.count_published(KEYS) == 0 and side.broken is None  # not paired yet: ask again later
    producer, consumer = hellos(auth=True)
    store.set("kvdi/p2p/hello/0", hs.json_text(producer))
    store.set(PAIRED_KEY, hs.json_text(consumer))
    session = Session(hs.session_key(TOKEN.encode(), producer, consumer))
    for key in (KEYS[0], KEYS[1], KEYS[3]):  # block 2 missing: the prefix is 2 blocks
        store.set(session.published(session.name(key)), "1")
    # TCPStore's set sends without waiting for a reply, and the lookup side asks on a connection of its own: one
    # round trip on this connection (check) makes the server apply the sets above before the lookups below arrive.
    assert store.check([PAIRED_KEY, session.published(session.name(KEYS[3]))])
    assert side.count_published(KEYS) == 2, side.broken
    assert side.count_published(KEYS[:1]) == 1, side.broken


def test_a_gone_store_breaks_lookups_within_the_timeout_and_they_answer_zero_after() -> None:
    from kvdi.connectors.p2p.rendezvous import host_store

    port = free_port()
    store = host_store("127.0.0.1", port, timedelta(seconds=10))
    side = lookups(port)
    assert side.count_published(KEYS) == 0  # connected, not paired
    del store  # the producer's process (and its store server) is gone
    start = time.monotonic()
    assert side.count_published(KEYS) == 0
    assert side.broken is not None and time.monotonic() - start < 2.0 + 2.0
    assert side.count_published(KEYS) == 0
