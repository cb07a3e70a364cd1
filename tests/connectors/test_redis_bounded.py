"""Reads bounded at the socket: a hostile RESP server cannot make one load cost more than one frame.

``GETRANGE key 0 limit`` bounds only servers that honour it. The servers here (a scripted RESP
server on loopback, as one server and as a one-node Redis Cluster) ignore the range and answer
a 64 MiB value, an endless error line, or a value trickled byte by byte: each is a counted bad
object or failure, the memory it costs stays near one frame, and the store serves again after.
"""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

redis = pytest.importorskip("redis")
pytest.importorskip("torch")

from kvdi.connectors.redis import RedisBlockStore, RedisClusterBlockStore  # noqa: E402
from kvdi.connectors.redis.bounded import OVERSIZED, CutReplies, Placed, read_replies  # noqa: E402
from kvdi.connectors.redis.wire import BAD_OBJECT, object_or_none, placed_size  # noqa: E402
from kvdi.settings import RedisSettings  # noqa: E402
from tests.connectors.test_redis_hostile import Reply, ScriptedRedis, save_then_load  # noqa: E402

pytestmark = pytest.mark.redis

HUGE = 64 << 20
FRAME = 4096  # the frame size the stores below are told (max_object_bytes)
HUGE_REPLY = b"$%d\r\n" % HUGE + bytes(HUGE) + b"\r\n"  # built once, before any memory is measured
KEY = b"k" * 16


def hostile_reads(reply: bytes, *, times: int | None = None) -> Reply:
    """A script that answers GETRANGE with ``reply`` (the first ``times`` reads; None: always)."""
    state = {"left": times}

    def script(args: list[bytes], data: dict[bytes, bytes]) -> bytes | None:
        if args[0].upper() != b"GETRANGE":
            return None
        if state["left"] is not None:
            if state["left"] == 0:
                return None
            state["left"] -= 1
        return reply

    return script


def as_cluster(server_port: Callable[[], int], inner: Reply) -> Reply:
    """``inner`` on a server that also calls itself a one-node Redis Cluster holding every slot."""

    def script(args: list[bytes], data: dict[bytes, bytes]) -> bytes | None:
        cmd = args[0].upper()
        if cmd == b"CLUSTER" and len(args) > 1 and args[1].upper() == b"SLOTS":
            return b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:%d\r\n$4\r\nnode\r\n" % server_port()
        if cmd == b"COMMAND":
            return b"*0\r\n"
        return inner(args, data)

    return script


@pytest.fixture
def serve() -> Iterator[Callable[[Reply, bool], tuple[ScriptedRedis, Any]]]:
    """``serve(script, cluster)``: a scripted server and a store on it (a cluster store when ``cluster``)."""
    made: list[tuple[ScriptedRedis, Any]] = []

    def make(script: Reply, cluster: bool) -> tuple[ScriptedRedis, Any]:
        box: dict[str, ScriptedRedis] = {}
        server = ScriptedRedis(as_cluster(lambda: box["s"].port, script) if cluster else script)
        box["s"] = server
        options = RedisSettings(url=server.url, cluster=cluster, op_timeout_s=0.5, connect_timeout_s=0.5)
        store_type = RedisClusterBlockStore if cluster else RedisBlockStore
        store = store_type(options, max_object_bytes=FRAME)
        made.append((server, store))
        return server, store

    yield make
    for server, store in made:
        store.close()
        server.close()


def cut_replies(store: Any) -> int:
    nodes = [store.node] if isinstance(store, RedisBlockStore) else list(store._nodes.values())
    return sum(node.cut_replies for node in nodes)


def frame(byte: int) -> bytes:
    return bytes([byte]) * FRAME


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_a_64_mib_reply_to_a_bounded_read_costs_one_frame_and_is_a_counted_bad_object(
    serve: Callable[[Reply, bool], tuple[ScriptedRedis, Any]], cluster: bool
) -> None:
    _, store = serve(hostile_reads(HUGE_REPLY, times=1), cluster)
    assert store.put_many([(KEY, [frame(7)])]) == 1
    tracemalloc.start()
    try:
        (value,) = store.get_many([KEY])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert value == BAD_OBJECT and cut_replies(store) == 1
    assert peak < 8 * FRAME + (1 << 20)  # never the 64 MiB the server announced
    (again,) = store.get_many([KEY])  # a fresh connection: the store serves on
    assert bytes(again) == frame(7)


@pytest.mark.parametrize("cluster", [False, True], ids=["server", "cluster"])
def test_later_replies_of_a_cut_batch_are_misses(
    serve: Callable[[Reply, bool], tuple[ScriptedRedis, Any]], cluster: bool
) -> None:
    _, store = serve(hostile_reads(HUGE_REPLY, times=1), cluster)
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    assert store.put_many([(k, [frame(i)]) for i, k in enumerate(keys)]) == 4
    values = store.get_many(keys)
    assert values[0] == BAD_OBJECT and values[1:] == [None, None, None]


def test_an_endless_error_line_is_cut(serve: Callable[[Reply, bool], tuple[ScriptedRedis, Any]]) -> None:
    _, store = serve(hostile_reads(b"-ERR " + b"x" * (4 << 20) + b"\r\n", times=1), False)
    store.put_many([(KEY, [frame(1)])])
    assert store.get_many([KEY]) == [BAD_OBJECT] and cut_replies(store) == 1


def test_a_trickled_reply_is_a_failure_within_the_op_timeout() -> None:
    """A server that announces one frame and sends it one byte at a time, each within the socket timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve_one() -> None:
        conn, _ = listener.accept()
        stream = conn.makefile("rb")
        try:
            while not stop.is_set():
                line = stream.readline()
                if not line.startswith(b"*"):
                    return
                args = [stream.read(int(stream.readline()[1:]) + 2)[:-2] for _ in range(int(line[1:]))]
                if args[0].upper() == b"HELLO":
                    conn.sendall(b"%1\r\n$5\r\nproto\r\n:3\r\n")
                elif args[0].upper() == b"GETRANGE":
                    conn.sendall(b"$%d\r\n" % FRAME)
                    for _ in range(FRAME):
                        if stop.wait(0.05):
                            return
                        conn.sendall(b"\0")
                else:
                    conn.sendall(b"+OK\r\n")
        except OSError:
            return
        finally:
            conn.close()

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    store = RedisBlockStore(
        RedisSettings(url=f"redis://127.0.0.1:{port}/0", op_timeout_s=0.5, connect_timeout_s=0.5),
        max_object_bytes=FRAME,
    )
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):  # a failed read (the worker counts it and recomputes) ...
            store.get_many([KEY])
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        store.close()
        listener.close()
        thread.join(5)
    assert elapsed < 5.0  # ... after about op_timeout_s, not FRAME * 0.05 s


def test_the_engine_counts_a_hostile_value_as_corrupt_and_recomputes(
    scripted: Callable[[Reply], ScriptedRedis],
) -> None:
    server = scripted(hostile_reads(HUGE_REPLY))
    stats, failed = save_then_load(server.url)
    assert stats.corrupt_dropped == 1 and stats.loaded_blocks == 0
    assert failed == set(range(4))


@pytest.fixture
def scripted() -> Iterator[Callable[[Reply], ScriptedRedis]]:
    servers: list[ScriptedRedis] = []

    def make(script: Reply) -> ScriptedRedis:
        servers.append(ScriptedRedis(script))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


# -- the reader on random streams -----------------------------------------------------------------


def replies_from(
    stream: bytes, count: int, bound: int, targets: list[list[memoryview]] | None = None
) -> list[object] | Exception:
    a, b = socket.socketpair()
    try:
        b.sendall(stream)
        b.shutdown(socket.SHUT_WR)
        a.settimeout(1.0)
        return read_replies(a, count, bound, 1.0, targets)
    except (CutReplies, OSError) as exc:  # ConnectionError and TimeoutError are OSErrors
        return exc
    finally:
        a.close()
        b.close()


resp_pieces = st.sampled_from(
    [b"$3\r\nabc\r\n", b"$-1\r\n", b"_\r\n", b"-ERR no\r\n", b":5\r\n", b"+OK\r\n", b"*1\r\n", b"$99\r\n", b"$x\r\n"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(resp_pieces | st.binary(max_size=16), max_size=6), st.integers(1, 4), st.integers(0, 8))
def test_random_streams_never_give_more_than_the_bound_nor_an_unexpected_exception(
    pieces: list[bytes], count: int, bound: int
) -> None:
    outcome = replies_from(b"".join(pieces), count, bound)
    replies = outcome.replies if isinstance(outcome, CutReplies) else outcome
    if isinstance(replies, Exception):
        return
    assert len(replies) == count
    for reply in replies:
        value = object_or_none(reply, bound - 1)
        assert value is None or len(value) <= bound
        assert reply is not OVERSIZED or value == BAD_OBJECT


def test_a_value_of_its_targets_size_is_read_into_the_target_and_nothing_else_is() -> None:
    """With targets, a value of exactly the target's size lands in it (split over its pieces) and is answered
    :class:`Placed`; a value of another size, or an integer reply of the target's size, leaves it untouched."""
    targets = [[memoryview(bytearray(4)), memoryview(bytearray(4))] for _ in range(3)]
    replies = replies_from(b"$8\r\nabcdefgh\r\n$3\r\nxyz\r\n:8\r\n", 3, 16, targets)
    assert isinstance(replies, list)
    assert [placed_size(r, 15, t) for r, t in zip(replies, targets, strict=True)] == [8, 3, 0]
    assert isinstance(replies[0], Placed) and [bytes(v) for v in targets[0]] == [b"abcd", b"efgh"]
    assert all(bytes(v) == bytes(4) for t in targets[1:] for v in t)


@settings(max_examples=300, deadline=None)
@given(st.lists(resp_pieces | st.binary(max_size=16), max_size=6), st.integers(1, 4), st.integers(0, 8))
def test_random_streams_read_into_targets_stay_bounded_and_only_placed_values_fill_them(
    pieces: list[bytes], count: int, bound: int
) -> None:
    targets = [[memoryview(bytearray(1)), memoryview(bytearray(2))] for _ in range(count)]
    outcome = replies_from(b"".join(pieces), count, bound, targets)
    replies = outcome.replies if isinstance(outcome, CutReplies) else outcome
    if isinstance(replies, Exception):
        return
    assert len(replies) == count
    for reply, target in zip(replies, targets, strict=True):
        size = placed_size(reply, bound - 1, target)
        assert size is None or size <= bound
        if not isinstance(reply, Placed):
            assert all(bytes(v) == bytes(v.nbytes) for v in target)  # never written
