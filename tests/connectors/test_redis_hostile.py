"""A hostile Redis: replies of the wrong type, garbage, huge values. Each is a counted miss, never a failed request.

The server here is a tiny scripted RESP server on a loopback socket (a thread), speaking
enough RESP2/RESP3 for redis-py's handshake; each test scripts what it answers. The huge
value test also runs against a real redis-server.
"""

from __future__ import annotations

import socket
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

redis = pytest.importorskip("redis")
torch = pytest.importorskip("torch")

from kvdi.connectors.base import (  # noqa: E402
    BlockTransfer,
    BlockTransferMetadata,
    KVRequest,
    SchedulerConnector,
    WorkerConnector,
    run_transfer_step,
)
from kvdi.connectors.redis import RedisBlockStore  # noqa: E402
from kvdi.connectors.redis.wire import BAD_OBJECT, object_or_none, present, written  # noqa: E402
from kvdi.connectors.store.framing import HEADER_SIZE  # noqa: E402
from kvdi.connectors.store.keys import block_keys  # noqa: E402
from kvdi.containers import KVTransferContainer, build_engine_container, build_kv_container  # noqa: E402
from kvdi.settings import RedisSettings  # noqa: E402
from kvdi.testing.redis_server import RedisServer  # noqa: E402

pytestmark = pytest.mark.redis

NUM_BLOCKS = 16
PROMPT = [(i * 37) % 1000 + 1 for i in range(16 * 4 + 3)]  # four full blocks and a tail
HUGE = 64 << 20

Reply = Callable[[list[bytes], dict[bytes, bytes]], bytes | None]


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def honest(args: list[bytes], data: dict[bytes, bytes]) -> bytes:
    """What a real server answers (for the commands kvdi sends)."""
    cmd = args[0].upper()
    if cmd == b"HELLO":
        return b"%1\r\n$5\r\nproto\r\n:3\r\n"
    if cmd == b"CLIENT":
        return b"+OK\r\n"
    if cmd == b"SET":
        data[args[1]] = args[2]
        return b"+OK\r\n"
    if cmd == b"STRLEN":
        return b":%d\r\n" % len(data.get(args[1], b""))
    if cmd == b"GETRANGE":
        value = data.get(args[1], b"")
        return bulk(value[int(args[2]) : int(args[3]) + 1])
    if cmd == b"GET":
        return bulk(data[args[1]]) if args[1] in data else b"_\r\n"
    if cmd == b"DEL":
        return b":%d\r\n" % (data.pop(args[1], None) is not None)
    return b"-ERR unknown command\r\n"


class ScriptedRedis:
    """A RESP server on 127.0.0.1 in a thread: ``script(args, data)`` answers (None: as a real server would)."""

    def __init__(self, script: Reply) -> None:
        self.script = script
        self.data: dict[bytes, bytes] = {}
        self.largest_reply = 0
        self.commands: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self._listener.close()
        for conn in self._conns:
            conn.close()
        self._accepting.join(timeout=2)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()

    @staticmethod
    def read_command(stream: Any) -> list[bytes] | None:
        """One RESP command (an array of bulk strings) from ``stream``; None when the client is done."""
        line = stream.readline()
        if not line.startswith(b"*"):
            return None
        args = []
        for _ in range(int(line[1:])):
            size = int(stream.readline()[1:])
            args.append(stream.read(size + 2)[:size])
        return args

    def _serve(self, conn: socket.socket) -> None:
        stream = conn.makefile("rb")
        try:
            while (args := self.read_command(stream)) is not None:
                self.commands.append(args[0].upper())
                reply = self.script(args, self.data)
                if reply is None:
                    reply = honest(args, self.data)
                self.largest_reply = max(self.largest_reply, len(reply))
                conn.sendall(reply)
        except (OSError, ValueError):
            return


@pytest.fixture
def scripted() -> Iterator[Callable[[Reply], ScriptedRedis]]:
    servers: list[ScriptedRedis] = []

    def make(script: Reply) -> ScriptedRedis:
        servers.append(ScriptedRedis(script))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def settings(url: str) -> dict[str, Any]:
    return {
        "kv_connector": "redis",
        "allocator": {"device": "cpu", "num_blocks": NUM_BLOCKS},
        "redis": {"url": url, "op_timeout_s": 0.5, "connect_timeout_s": 0.5, "breaker_reset_s": 0.2},
    }


def save_then_load(url: str, break_reads: Callable[[], None] | None = None) -> tuple[Any, set[int]]:
    """Save PROMPT's blocks with one worker half, then load them with another; the loader's stats and failed ids."""
    containers: list[KVTransferContainer] = []
    try:
        saver = build_kv_container(**settings(url))
        containers.append(saver)
        layout = saver.layout()
        gen = torch.Generator().manual_seed(0)
        source = {n: torch.randn(NUM_BLOCKS, *layout.block_shape, generator=gen) for n in layout.layer_names}
        keys = tuple(block_keys(PROMPT, layout))
        ids = tuple(range(len(keys)))
        worker = saver.worker_connector()
        assert isinstance(worker, WorkerConnector)
        worker.register_kv_caches(source)
        run_transfer_step(worker, BlockTransferMetadata(saves=(BlockTransfer("p", ids, keys),)))
        if break_reads is not None:
            break_reads()
        loader = build_kv_container(**settings(url))
        containers.append(loader)
        scheduler = loader.scheduler_connector()
        assert isinstance(scheduler, SchedulerConnector)
        scheduler.get_num_new_matched_tokens(KVRequest("c", tuple(PROMPT)), 0)  # must not raise either
        half = loader.worker_connector()
        assert isinstance(half, WorkerConnector)
        half.register_kv_caches({n: torch.zeros(NUM_BLOCKS, *layout.block_shape) for n in layout.layer_names})
        failed = run_transfer_step(half, BlockTransferMetadata(loads=(BlockTransfer("c", ids, keys),)))
        return half.stats, failed
    finally:
        for container in containers:
            container.shutdown_resources()


WRONG_TYPES = {
    "integer": b":42\r\n",
    "array": b"*2\r\n:1\r\n$1\r\nx\r\n",
    "map": b"%1\r\n+a\r\n:1\r\n",
    "simple string": b"+OK\r\n",
    "double": b",3.5\r\n",
}


@pytest.mark.parametrize("name", sorted(WRONG_TYPES))
def test_a_read_answered_with_the_wrong_type_is_a_counted_corrupt_miss(
    name: str, scripted: Callable[[Reply], ScriptedRedis]
) -> None:
    server = scripted(lambda args, _: WRONG_TYPES[name] if args[0].upper() == b"GETRANGE" else None)
    stats, failed = save_then_load(server.url)
    assert stats.corrupt_dropped == 1 and stats.loaded_blocks == 0
    assert failed == set(range(4))  # recomputed, not failed
    assert b"DEL" in server.commands  # the bad object is dropped


def test_lookups_answered_with_the_wrong_type_are_misses(scripted: Callable[[Reply], ScriptedRedis]) -> None:
    server = scripted(lambda args, _: b"*1\r\n:1\r\n" if args[0].upper() == b"STRLEN" else None)
    store = RedisBlockStore(RedisSettings(url=server.url))
    assert store.count_prefix([b"k" * 16]) == 0
    store.close()


def test_set_replies_that_are_not_ok_are_not_counted_as_written(scripted: Callable[[Reply], ScriptedRedis]) -> None:
    replies = iter([b"+OK\r\n", b":1\r\n", b"-OOM no memory\r\n", b"+OK\r\n"])
    server = scripted(lambda args, _: next(replies) if args[0].upper() == b"SET" else None)
    store = RedisBlockStore(RedisSettings(url=server.url))
    assert store.put_many([(bytes([i]) * 16, [b"x" * 10]) for i in range(4)]) == 2
    store.close()


@pytest.mark.parametrize(
    "garbage",
    [b"+OK\r\n", b"?what\r\n", b"$99999999999999999999999\r\n", b"*-7\r\n:x\r\n"],
    ids=["ok-to-hello", "not-resp", "absurd-length", "broken-array"],
)
def test_a_garbled_handshake_or_reply_is_a_counted_load_failure(
    garbage: bytes, scripted: Callable[[Reply], ScriptedRedis]
) -> None:
    state = {"saved": False}

    def script(args: list[bytes], data: dict[bytes, bytes]) -> bytes | None:
        cmd = args[0].upper()
        if cmd == b"HELLO" and state["saved"] and garbage == b"+OK\r\n":
            return garbage
        if cmd == b"GETRANGE" and garbage != b"+OK\r\n":
            return garbage
        return None

    server = scripted(script)

    def break_reads() -> None:
        state["saved"] = True
        for conn in server._conns:  # new connections, new handshakes
            conn.close()

    stats, failed = save_then_load(server.url, break_reads)
    assert stats.loaded_blocks == 0 and stats.load_failures + stats.corrupt_dropped >= 1
    assert failed == set(range(4))


def test_a_64_mib_value_is_read_bounded_by_one_frame(scripted: Callable[[Reply], ScriptedRedis]) -> None:
    def huge(args: list[bytes], data: dict[bytes, bytes]) -> bytes | None:
        if args[0].upper() == b"SET":
            data[args[1]] = b"\0" * HUGE
            return b"+OK\r\n"
        return None

    server = scripted(huge)
    stats, failed = save_then_load(server.url)
    assert stats.corrupt_dropped == 1 and failed == set(range(4))
    frame = HEADER_SIZE + build_kv_container(**settings(server.url)).layout().block_bytes
    assert server.largest_reply < frame + 256  # GETRANGE asked for one frame (+ room), never 64 MiB


def test_a_64_mib_value_on_a_real_server_costs_at_most_one_frame_of_memory(redis_server: RedisServer) -> None:
    from kvdi.connectors.redis import open_store
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import load_settings

    loaded = load_settings(**settings(redis_server.url))
    layout = KVCacheSpec.from_settings(loaded)
    store = open_store(loaded.redis, layout, loaded)
    key = bytes(16)
    client = redis.Redis.from_url(redis_server.url)
    client.set(b"kvdi:" + key.hex().encode(), b"\0" * HUGE)
    client.close()
    tracemalloc.start()
    try:
        (value,) = store.get_many([key])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        store.close()
    frame = HEADER_SIZE + layout.block_bytes
    assert value is not None and len(value) <= frame + 256
    assert peak < 4 * frame + (1 << 20)


def test_wrong_type_value_reads_as_a_bad_object(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.hset(b"kvdi:" + bytes(16).hex().encode(), b"f", b"v")
    client.close()
    store = RedisBlockStore(RedisSettings(url=redis_server.url))
    assert store.count_prefix([bytes(16)]) == 1 and store.get_many([bytes(16)]) == [BAD_OBJECT]
    store.close()


def test_engine_on_a_server_answering_reads_with_integers_matches_recompute(
    scripted: Callable[[Reply], ScriptedRedis],
) -> None:
    server = scripted(lambda args, _: b":7\r\n" if args[0].upper() == b"GETRANGE" else None)
    outputs = []
    for connector, role in (("null", "kv_both"), ("redis", "kv_producer"), ("redis", "kv_consumer")):
        container = build_engine_container(**{**settings(server.url), "kv_connector": connector, "kv_role": role})
        try:
            engine = container.engine()
            outputs.append(engine.generate([PROMPT], 4))
            stats = engine.connector_stats().total
            engine.shutdown()
        finally:
            container.shutdown_resources()
    assert all(o.ok for run in outputs for o in run)
    assert outputs[2][0].output_token_ids == outputs[0][0].output_token_ids
    assert stats.corrupt_dropped >= 1 and stats.loaded_blocks == 0


_replies = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.binary(max_size=64) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.binary(max_size=4), inner, max_size=3),
    max_leaves=8,
) | st.builds(redis.ResponseError, st.text(max_size=8))


@given(_replies, st.integers(min_value=0, max_value=64))
def test_reply_classifiers_never_raise_and_never_return_more_than_one_frame(reply: object, limit: int) -> None:
    value = object_or_none(reply, limit)
    assert value is None or (isinstance(value, bytes | bytearray) and len(value) <= limit + 1)
    assert isinstance(present(reply), bool) and isinstance(written(reply), bool)
