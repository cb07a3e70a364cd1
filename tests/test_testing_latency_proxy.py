"""LatencyProxy: a real redis-server behind it answers, every round trip pays the delay both ways, it closes clean."""

from __future__ import annotations

import socket
import threading
import time

import pytest

redis = pytest.importorskip("redis")

from kvdi.testing.latency_proxy import LatencyProxy  # noqa: E402
from kvdi.testing.redis_server import RedisServer  # noqa: E402

DELAY_MS = 20.0


def test_redis_commands_pass_through_the_proxy(redis_server: RedisServer) -> None:
    """PING, SET and GET of a 1 MiB value through the proxy get the server's answers."""
    value = bytes(range(256)) * 4096
    with LatencyProxy(("127.0.0.1", redis_server.port), delay_ms=1) as proxy:
        client = redis.Redis.from_url(proxy.url("redis"))
        assert client.ping() is True
        assert client.set("k", value) is True
        assert client.get("k") == value
        client.close()


def test_a_round_trip_takes_at_least_twice_the_delay(redis_server: RedisServer) -> None:
    """Each PING waits ``delay_ms`` on the way in and again on the way out."""
    with LatencyProxy(("127.0.0.1", redis_server.port), delay_ms=DELAY_MS) as proxy:
        client = redis.Redis.from_url(proxy.url("redis"))
        client.ping()  # connect first: the handshake is not what is measured
        for _ in range(3):
            start = time.monotonic()
            client.ping()
            assert time.monotonic() - start >= 2 * DELAY_MS / 1000.0
        client.close()


def test_pipelined_replies_keep_their_order(redis_server: RedisServer) -> None:
    """200 pipelined SET/GET pairs come back in order, each GET with its own value."""
    with LatencyProxy(("127.0.0.1", redis_server.port), delay_ms=2) as proxy:
        client = redis.Redis.from_url(proxy.url("redis"))
        pipe = client.pipeline(transaction=False)
        for i in range(200):
            pipe.set(f"k{i}", str(i) * (i + 1))
            pipe.get(f"k{i}")
        replies = pipe.execute()
        assert replies[1::2] == [(str(i) * (i + 1)).encode() for i in range(200)]
        client.close()


def test_many_connections_at_once(redis_server: RedisServer) -> None:
    """Sixteen clients on their own threads each get their own value back."""
    errors: list[BaseException] = []
    with LatencyProxy(("127.0.0.1", redis_server.port), delay_ms=5) as proxy:

        def worker(i: int) -> None:
            try:
                client = redis.Redis.from_url(proxy.url("redis"))
                for j in range(5):
                    client.set(f"c{i}-{j}", f"{i}:{j}")
                    assert client.get(f"c{i}-{j}") == f"{i}:{j}".encode()
                client.close()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert errors == []


def test_close_ends_open_connections_and_threads(redis_server: RedisServer) -> None:
    """close() drops connected clients (their next read sees the end) and leaves no proxy thread behind."""
    before = {t.ident for t in threading.enumerate()}
    proxy = LatencyProxy(("127.0.0.1", redis_server.port), delay_ms=1)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.sendall(b"PING\r\n")
    assert sock.recv(64) == b"+PONG\r\n"
    proxy.close()
    assert sock.recv(64) == b""
    sock.close()
    left = [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("latency-proxy")]
    assert left == []


def test_a_negative_delay_is_refused() -> None:
    """delay_ms below zero is a ValueError naming the value."""
    with pytest.raises(ValueError, match="-1"):
        LatencyProxy(("127.0.0.1", 1), delay_ms=-1)
