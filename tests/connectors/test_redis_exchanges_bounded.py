"""Every Redis exchange is bounded and under one deadline, not only reads (issue 28, item 2).

A hostile server answers a lookup's ``STRLEN`` or a save's ``SET`` with a 600 MB bulk string, or
trickles honest replies a byte at a time, each byte within the socket timeout. Each exchange reads
its replies with a bound fitting what it expects (a few bytes for an integer or a status) and must
be done within ``op_timeout_s`` as a whole: the hostile reply costs no memory to speak of and the
call fails (a miss, a failed save) within ``op_timeout_s`` plus one second.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

redis = pytest.importorskip("redis")
pytest.importorskip("torch")

from kvdi.connectors.redis import RedisBlockStore, RedisClusterBlockStore  # noqa: E402
from kvdi.settings import RedisSettings  # noqa: E402
from tests.connectors.test_redis_bounded import as_cluster  # noqa: E402
from tests.connectors.test_redis_hostile import ScriptedRedis, honest  # noqa: E402

pytestmark = pytest.mark.redis

OP_TIMEOUT_S = 0.5
HUGE = 600 * 10**6
KEY = b"k" * 16

Stream = Callable[[list[bytes], dict[bytes, bytes]], Iterable[bytes] | bytes | None]


class StreamingRedis(ScriptedRedis):
    """A scripted RESP server whose script may answer with an iterable of chunks, sent one after the other."""

    def __init__(self, script: Stream) -> None:
        super().__init__(script)  # type: ignore[arg-type]

    def _serve(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        try:
            while (args := self.read_command(stream)) is not None:
                reply: Any = self.script(args, self.data)
                for chunk in (
                    [honest(args, self.data)] if reply is None else [reply] if isinstance(reply, bytes) else reply
                ):
                    conn.sendall(chunk)
        except (OSError, ValueError):
            return


def huge_bulk() -> Iterator[bytes]:
    """A 600 MB bulk string, sent 1 MiB at a time (never held whole by the server either)."""
    yield b"$%d\r\n" % HUGE
    chunk = bytes(1 << 20)
    for _ in range(HUGE // len(chunk)):
        yield chunk
    yield bytes(HUGE % len(chunk)) + b"\r\n"


def trickled(reply: bytes, every_s: float) -> Iterator[bytes]:
    """``reply`` one byte at a time, ``every_s`` apart (each byte well within the socket timeout)."""
    for byte in reply:
        time.sleep(every_s)
        yield bytes([byte])


def answering(command: bytes, reply: Callable[[list[bytes], dict[bytes, bytes]], Iterable[bytes]]) -> Stream:
    def script(args: list[bytes], data: dict[bytes, bytes]) -> Iterable[bytes] | None:
        return reply(args, data) if args[0].upper() == command else None

    return script


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class PeakRss:
    """The largest growth of this process's resident memory while the block runs (sampled every 2 ms)."""

    def __enter__(self) -> PeakRss:
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def grown(self) -> int:
        return self.peak - self.base


@pytest.fixture
def serve() -> Iterator[Callable[[Stream, bool], Any]]:
    """``serve(script, cluster)``: a streaming scripted server and a store on it (op_timeout_s=0.5)."""
    made: list[tuple[StreamingRedis, Any]] = []

    def make(script: Stream, cluster: bool) -> Any:
        box: dict[str, StreamingRedis] = {}
        server = StreamingRedis(as_cluster(lambda: box["s"].port, script) if cluster else script)  # type: ignore[arg-type]
        box["s"] = server
        options = RedisSettings(url=server.url, cluster=cluster, op_timeout_s=OP_TIMEOUT_S, connect_timeout_s=0.5)
        store = (RedisClusterBlockStore if cluster else RedisBlockStore)(options, max_object_bytes=4096)
        made.append((server, store))
        return store

    yield make
    for server, store in made:
        store.close()
        server.close()


def lookup(store: Any) -> object:
    try:
        return store.count_prefix([KEY])
    except OSError as exc:
        return exc


def save(store: Any) -> object:
    try:
        return store.put_many([(KEY, [b"x" * 64])])
    except OSError as exc:
        return exc


CALLS = {"STRLEN": (b"STRLEN", lookup), "SET": (b"SET", save)}


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
@pytest.mark.parametrize("command", sorted(CALLS))
def test_a_600_mb_reply_to_a_lookup_or_a_save_costs_no_memory_and_fails_within_the_deadline(
    serve: Callable[[Stream, bool], Any], command: str, cluster: bool
) -> None:
    """A STRLEN or SET answered with a 600 MB bulk string: < 64 MiB of memory, over within op_timeout_s + 1 s."""
    name, call = CALLS[command]
    store = serve(answering(name, lambda args, data: huge_bulk()), cluster)
    started = time.monotonic()
    with PeakRss() as rss:
        outcome = call(store)
    elapsed = time.monotonic() - started
    assert outcome in (0, None) or isinstance(outcome, OSError)  # a miss or a failed save, never a hit
    assert rss.grown < 64 << 20, f"{rss.grown >> 20} MiB for one {command} reply"
    assert elapsed < OP_TIMEOUT_S + 1.0, f"{elapsed:.1f} s for one {command} reply"


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
@pytest.mark.parametrize("command", sorted(CALLS))
def test_a_trickled_reply_to_a_lookup_or_a_save_fails_within_the_deadline(
    serve: Callable[[Stream, bool], Any], command: str, cluster: bool
) -> None:
    """An honest reply sent one byte every 0.3 s (each byte under the 0.5 s socket timeout) is a failure after
    op_timeout_s, not after the seconds the bytes take to add up."""
    name, call = CALLS[command]
    honest_reply = {b"STRLEN": b":1234567\r\n", b"SET": b"+OK\r\n"}[name]
    store = serve(answering(name, lambda args, data: trickled(honest_reply, 0.3)), cluster)
    started = time.monotonic()
    outcome = call(store)
    elapsed = time.monotonic() - started
    assert outcome == 0 or isinstance(outcome, OSError)
    assert elapsed < OP_TIMEOUT_S + 1.0, f"{elapsed:.1f} s for one trickled {command} reply"


def test_honest_integer_replies_trickled_under_the_socket_timeout_cannot_add_up(
    serve: Callable[[Stream, bool], Any],
) -> None:
    """A lookup of 32 keys whose every STRLEN reply arrives within the socket timeout but all of them together
    take 32 x 0.2 s: the lookup ends after op_timeout_s (a miss), not after 6 s."""
    store = serve(answering(b"STRLEN", lambda args, data: trickled(b":0\r\n", 0.05)), False)
    started = time.monotonic()
    with contextlib.suppress(OSError):
        store.count_prefix([bytes([i]) * 16 for i in range(32)])
    assert time.monotonic() - started < OP_TIMEOUT_S + 1.0


def test_the_store_serves_again_after_a_hostile_reply(serve: Callable[[Stream, bool], Any]) -> None:
    """The connection that carried the hostile reply is dropped; the next exchange is honest and works."""
    state = {"hostile": True}

    def script(args: list[bytes], data: dict[bytes, bytes]) -> Iterable[bytes] | None:
        if args[0].upper() == b"STRLEN" and state["hostile"]:
            state["hostile"] = False
            return huge_bulk()
        return None

    store = serve(script, False)
    assert store.put_many([(KEY, [b"x" * 64])]) == 1
    first = lookup(store)
    assert first == 0 or isinstance(first, OSError)
    assert store.count_prefix([KEY]) == 1


def admin_script(hostile: bytes) -> Stream:
    """A store of one object ``kvdi:<32 hex>``: SCAN, STRLEN and OBJECT answered honestly, ``hostile`` with 600 MB."""
    name = b"kvdi:" + b"ab" * 16

    def script(args: list[bytes], data: dict[bytes, bytes]) -> Iterable[bytes] | bytes | None:
        cmd = args[0].upper()
        if cmd == hostile:
            return huge_bulk()
        if cmd == b"SCAN":
            return b"*2\r\n$1\r\n0\r\n*1\r\n$%d\r\n%s\r\n" % (len(name), name)
        if cmd == b"STRLEN":
            return b":4096\r\n"
        if cmd == b"OBJECT":
            return b":5\r\n"
        if cmd == b"PING":
            return b"+PONG\r\n"
        return None

    return script


@pytest.mark.parametrize("hostile", [b"SCAN", b"GETRANGE"])
def test_kvdi_store_stats_on_a_hostile_server_costs_no_memory(hostile: bytes) -> None:
    """Administration exchanges are bounded too: a 600 MB SCAN reply is an error (one line in the CLI), a 600 MB
    reply to the header read makes the object foreign; neither costs memory nor more than the deadline."""
    from kvdi.admin import open_admin, store_stats
    from kvdi.settings import load_settings

    server = StreamingRedis(admin_script(hostile))
    try:
        settings = load_settings(kv_connector="redis", redis={"url": server.url, "op_timeout_s": OP_TIMEOUT_S})
        admin = open_admin(settings)
        started = time.monotonic()
        with PeakRss() as rss:
            try:
                outcome: object = store_stats(admin)
            except OSError as exc:
                outcome = exc
            finally:
                admin.close()
        elapsed = time.monotonic() - started
    finally:
        server.close()
    assert rss.grown < 64 << 20 and elapsed < OP_TIMEOUT_S + 1.0
    if hostile == b"SCAN":
        assert isinstance(outcome, OSError)
    else:
        assert not isinstance(outcome, OSError) and outcome.foreign == 1 and outcome.total.objects == 0  # type: ignore[attr-defined]
