"""One Redis server: :class:`RedisNode` (the calls, behind a breaker) and :class:`RedisBlockStore` over it.

Each block is one key (``key_prefix`` + hex of the block key) written with a single ``SET`` (``EX`` when ``ttl_s``
is set), so a reader sees a whole object or nothing. Batches travel as one packed pipeline per server (one round
trip), never in a transaction. Lookups use ``STRLEN`` (an existence check that also sees empty values as absent);
reads use ``GETRANGE key 0 limit`` when the frame size is known, and read those replies off the socket with a bound
(:mod:`.bounded`), so a huge value costs at most one frame of memory even on a server that ignores the range.
``get_into_many`` reads each frame off the socket straight into the pieces it is loaded into (on a CPU cache, the
paged cache itself: no buffer, no copy, no allocation per load); the worker half verifies it there (with
``compression`` set, blocks are compressed in ``put_many`` and read whole instead:
:mod:`kvdi.connectors.store.codec`). Replies are read raw and classified (:mod:`.wire`): a reply of the wrong type
is a bad object or a miss, never an exception from redis-py's callbacks.

A dead or hung server costs a miss, not a stall: every call is bounded by ``connect_timeout_s`` / ``op_timeout_s``
and never retried, and after ``breaker_failures`` consecutive failures the node stops calling the server for
``breaker_reset_s`` (reads answer as misses, writes raise :class:`ConnectionError` at once). Failures surface as
builtin :class:`ConnectionError` / :class:`TimeoutError` / :class:`OSError` (anything redis-py raises on a garbled
or unexpected reply included), and the URL's password is shown as ``***`` everywhere.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, overload

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvdi.connectors.logging_once import log_once
from kvdi.connectors.redis.bounded import INFO, Bounds, CutReplies, read_replies
from kvdi.connectors.redis.breaker import BreakerOpenError, BreakerState, CircuitBreaker
from kvdi.connectors.redis.exchange import Exchange as Exchange  # re-exported: cluster, kvdi store
from kvdi.connectors.redis.exchange import pack_command as pack_command
from kvdi.connectors.redis.ranges import server_ranges
from kvdi.connectors.redis.wire import (
    describe,
    describe_reply,
    object_or_none,
    pack_sets,
    placed_size,
    present,
    run_timed,
    send_gathered,
    written,
)
from kvdi.connectors.store.framing import Buffer
from kvdi.errors import ConfigError
from kvdi.masking import mask_url

if TYPE_CHECKING:
    from kvdi.connectors.store.codec import Compressor
    from kvdi.settings import RedisSettings

logger = logging.getLogger(__name__)


def client_options(options: RedisSettings) -> dict[str, Any]:
    """redis-py keyword arguments every kvdi connection uses: bounded timeouts, no retries, no health pings."""
    return {
        "socket_connect_timeout": options.connect_timeout_s,
        "socket_timeout": options.op_timeout_s,
        "health_check_interval": 0,
    }


class RedisNode:
    """One Redis server behind its own circuit breaker; safe to share across threads.

    :meth:`send` then :meth:`receive` run an :class:`Exchange` (callers send to every node of
    a batch first, then read, as a cluster pipeline does). Neither raises: the outcome is in
    ``exchange.result``, an ``OSError`` when the node failed or its breaker is open.
    """

    def __init__(self, client: redis.Redis, label: str, breaker: CircuitBreaker, address: str = "") -> None:
        self.client = client
        self.label = label
        self.breaker = breaker
        self.address = address  # host:port of a cluster node ("" for a single server)
        self.cut_replies = 0
        """Read batches cut short: a reply longer than one frame (whatever the server claimed), or of an
        aggregate type; the reply is a bad object, the rest of its batch misses, the connection dropped."""
        self._logged: set[str] = set()

    def run(self, exchange: Exchange) -> Exchange:
        """:meth:`send` and :meth:`receive` one exchange."""
        self.send(exchange)
        self.receive(exchange)
        return exchange

    def send(self, exchange: Exchange) -> None:
        if not self.breaker.allow():
            exchange.result = BreakerOpenError(
                f"redis at {self.label}: {exchange.op} refused, circuit breaker open after "
                f"{self.breaker.threshold} consecutive failures (retrying after {self.breaker.reset_s}s)"
            )
            return
        pool: Any = self.client.connection_pool
        exchange.deadline = time.monotonic() + self._timeout()
        try:
            try:
                conn = pool.get_connection()
            except TypeError:  # redis-py < 5.3 wants a command name
                conn = pool.get_connection("SET")
        except Exception as exc:
            exchange.result = self._failed(exchange.op, exc)
            return
        exchange._conn = conn
        try:
            sock = getattr(conn, "_sock", None)
            if type(sock) is socket.socket and hasattr(sock, "sendmsg"):
                # One gathered syscall for many pieces instead of one sendall each. TLS sockets
                # (a subclass) and platforms without sendmsg take redis-py's own path.
                send_gathered(sock, exchange.chunks, exchange.deadline)
            else:
                conn.send_packed_command(exchange.chunks, check_health=False)
        except Exception as exc:
            exchange.result = self._failed(exchange.op, exc)
            self._drop(exchange)

    def receive(self, exchange: Exchange) -> None:
        if exchange.result is not None:
            return
        conn = exchange._conn
        replies: list[object] = []
        try:
            sock = getattr(conn, "_sock", None)
            if sock is None:
                raise ConnectionError("the connection has no socket")
            replies = read_replies(
                sock, exchange.replies, exchange.bounds, self._timeout(), exchange.targets, exchange.deadline
            )
        except CutReplies as cut:  # the server answered, but past what a frame can be: never read on
            self.cut_replies += 1
            log_once(logger, self._logged, "cut", "redis at %s: %s: reply cut, connection dropped", self.label, cut.why)
            self._drop(exchange)
            exchange.result = cut.replies
            return
        except Exception as exc:  # a dead socket, a timeout, or a reply redis-py could not parse
            exchange.result = self._failed(exchange.op, exc)
            self._drop(exchange)
            return
        self.client.connection_pool.release(conn)
        exchange._conn = None
        if self.breaker.record_success():
            logger.info("redis at %s answers again: circuit breaker closed", self.label)
        exchange.result = replies

    def _timeout(self) -> float:
        """The store's ``op_timeout_s`` (redis-py's socket timeout): the deadline of one whole exchange."""
        return float(self.client.connection_pool.connection_kwargs.get("socket_timeout") or 2.0)

    def _drop(self, exchange: Exchange) -> None:
        """Disconnect and release a connection whose stream is out of step (half sent or half read)."""
        conn, exchange._conn = exchange._conn, None
        if conn is not None:
            try:
                conn.disconnect()
            finally:
                self.client.connection_pool.release(conn)

    def _failed(self, op: str, exc: BaseException) -> OSError:
        """Feed the breaker and turn ``exc`` into a builtin OSError naming the masked address."""
        if isinstance(exc, redis.ResponseError):
            # The server answered (e.g. NOAUTH during the handshake): it is alive.
            self.breaker.record_success()
            return OSError(f"redis at {self.label}: {op} rejected by the server ({describe(exc)})")
        # Drop pooled sockets: after a restart they are all dead, and one would fail the probe.
        self.client.connection_pool.disconnect()
        if self.breaker.record_failure():
            logger.warning(
                "redis at %s: %s failed (%s); circuit breaker open for %ss: loads miss, saves fail fast",
                self.label,
                op,
                describe(exc),
                self.breaker.reset_s,
            )
        if isinstance(exc, redis.TimeoutError | TimeoutError):
            return TimeoutError(f"redis at {self.label}: {op} timed out ({describe(exc)})")
        if isinstance(exc, redis.ConnectionError | OSError):  # also AuthenticationError, raw socket errors
            return ConnectionError(f"redis at {self.label}: {op} failed ({describe(exc)})")
        # A reply of the wrong type, a garbled stream, an absurd length: the server is unusable.
        return OSError(f"redis at {self.label}: {op} got an unusable reply ({type(exc).__name__}: {describe(exc)})")


UNSIZED_READ_BYTES = 1 << 30  # the bound of a read whose frame size the store was not told


def lookup_exchange(node: RedisNode, names: Sequence[bytes]) -> Exchange:
    """``STRLEN`` per name (read replies with :func:`~.wire.present`)."""
    return Exchange(node, [b"".join(pack_command(b"STRLEN", n) for n in names)], len(names), "count_prefix")


def read_exchange(
    node: RedisNode, names: Sequence[bytes], limit: int | None, targets: Sequence[Sequence[memoryview]] | None = None
) -> Exchange:
    """``GETRANGE name 0 limit`` per name (``GET`` without a limit); read replies with :func:`~.wire.object_or_none`
    (:func:`~.wire.placed_size` with ``targets``).

    With a limit the replies are read off the socket with a bound of ``limit + 1`` bytes each
    (:mod:`.bounded`), whatever length the server announces, each value of its target's size
    straight into the target."""
    if limit is None:  # no frame size known: still bounded, by the largest frame any store reads
        packed = b"".join(pack_command(b"GET", n) for n in names)
        return Exchange(node, [packed], len(names), "get_many", bounds=Bounds(UNSIZED_READ_BYTES))
    end = str(limit).encode()
    packed = b"".join(pack_command(b"GETRANGE", n, b"0", end) for n in names)
    return Exchange(node, [packed], len(names), "get_many", bounds=Bounds(limit + 1), targets=targets)


def write_exchange(
    node: RedisNode, prefix: bytes, items: Sequence[tuple[bytes, Sequence[Buffer]]], ttl_s: int | None,
    compressor: Compressor | None = None,
) -> Exchange:  # fmt: skip
    """One ``SET`` per item (replies read with :func:`~.wire.written`), compressed first with ``compressor``."""
    items = items if compressor is None else compressor.frame_all(items)
    return Exchange(node, pack_sets(prefix, items, ttl_s), len(items), "put_many")


def count_written(exchange: Exchange, logged: set[str]) -> int:
    """How many SETs of a finished write exchange stored their object; the first rejection is logged once."""
    assert isinstance(exchange.result, list)
    count = 0
    for reply in exchange.result:
        if written(reply):
            count += 1
        else:
            log_once(logger, logged, exchange.node.label, "redis at %s: a SET was not stored: %s", exchange.node.label,
                     describe_reply(reply))  # fmt: skip
    return count


class RedisBlockStore:
    """A :class:`~kvdi.connectors.store.BlockStore` over one Redis server; safe to share across threads.

    ``max_object_bytes`` (the frame size, when known) bounds every read: a larger value is
    read as its first ``max_object_bytes + 1`` bytes, which no frame check accepts.
    """

    prefers_async_load = False
    """Measured, not assumed: inside vLLM (CPU, loopback Redis) an asynchronous loading round took
    0.53 s against 0.26 s recomputed and 0.06-0.09 s loading synchronously, so ``auto`` loads Redis
    synchronously; ``KVDI_TRANSFER__ASYNC_LOAD=on`` still loads it beside the compute."""
    compressor: Compressor | None = None  # KVDI_REDIS__COMPRESSION (set by open_store): blocks compressed on writes
    get_range_into_many = server_ranges  # bytes from an offset into pieces (a pack's sections): :mod:`.ranges`

    def __init__(self, options: RedisSettings, max_object_bytes: int | None = None) -> None:
        raw_url = options.url.get_secret_value()
        self.url = mask_url(raw_url)
        self.key_prefix = options.key_prefix
        self.ttl_s = options.ttl_s
        self.max_object_bytes = max_object_bytes
        self._prefix = options.key_prefix.encode()
        self._logged: set[str] = set()
        try:
            client: redis.Redis = redis.Redis.from_url(
                raw_url,
                # No retries: a retry on a dead server doubles the stall the breaker exists to bound.
                retry=Retry(NoBackoff(), 0),
                retry_on_error=[],
                **client_options(options),
            )
        except (ValueError, redis.RedisError) as exc:
            # redis-py's parse errors may quote the URL; show only the masked one.
            raise ConfigError(
                f"redis.url (KVDI_REDIS__URL={self.url}) cannot be used: {type(exc).__name__}; "
                "expected redis://[[user]:password@]host[:port][/db], rediss://... or unix:///path"
            ) from None
        self.node = RedisNode(client, self.url, CircuitBreaker(options.breaker_failures, options.breaker_reset_s))

    @property
    def breaker(self) -> CircuitBreaker:
        return self.node.breaker

    def __repr__(self) -> str:
        return f"RedisBlockStore(url={self.url!r}, key_prefix={self.key_prefix!r}, breaker={self.breaker.state.value})"

    # BlockStore protocol

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, hold an object (pipelined STRLENs); 0 while the breaker is open."""
        return self.count_prefix_many([keys])[0]

    def count_prefix_many(self, key_lists: Sequence[Sequence[bytes]]) -> list[int]:
        """:meth:`count_prefix` of each list in one pipeline (a step's background lookups in one round trip,
        :mod:`kvdi.connectors.store.lookups`); all 0 while the breaker is open."""
        names = [self._name(k) for keys in key_lists for k in keys]
        replies = (self._replies(lookup_exchange(self.node, names), miss=True) if names else []) or []
        counts, at = [], 0
        for keys in key_lists:
            mine, at = replies[at : at + len(keys)], at + len(keys)
            counts.append(next((i for i, reply in enumerate(mine) if not present(reply)), len(mine)))
        return counts

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Each key's object (at most ``max_object_bytes + 1`` bytes) or None; all None while the breaker is open."""
        if not keys:
            return []
        replies = self._replies(
            read_exchange(self.node, [self._name(k) for k in keys], self.max_object_bytes), miss=True
        )
        if replies is None:
            return [None] * len(keys)
        return [object_or_none(r, self.max_object_bytes) for r in replies]

    def get_into_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        """Each key's object read straight into its pieces when it has their size (the socket's bytes land in
        the cache, no buffer between), else its size with the pieces untouched; None when absent or the
        breaker is open. Pieces may be partly written for a key that then answers None (a failed read)."""
        if not items:
            return []
        names = [self._name(k) for k, _ in items]
        targets = [pieces for _, pieces in items]
        replies = self._replies(read_exchange(self.node, names, self.max_object_bytes, targets), miss=True)
        if replies is None:
            return [None] * len(items)
        limit = self.max_object_bytes
        return [placed_size(r, limit, p) for r, p in zip(replies, targets, strict=True)]

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> int:
        """One ``SET`` per object (``EX`` when ``ttl_s``) in one pipeline; returns how many were stored. Raises
        ConnectionError while the breaker is open, OSError when the server failed or stored none of them. Packed
        here, not by redis-py, so an object's pieces go to the socket as they are (joining would copy them)."""
        if not items:
            return 0
        exchange = write_exchange(self.node, self._prefix, items, self.ttl_s, self.compressor)
        exchange = run_timed(self.node.run, exchange, self.compressor)  # compression=auto measures the link
        if isinstance(exchange.result, OSError):
            raise exchange.result
        count = count_written(exchange, self._logged)
        if count == 0:
            first = describe_reply(exchange.result[0]) if exchange.result else "no reply"
            raise OSError(f"redis at {self.url}: put_many rejected by the server ({first})")
        return count

    def discard(self, key: bytes) -> None:
        """``DEL`` one key (absent keys are fine); raises ConnectionError while the breaker is open."""
        self._replies(Exchange(self.node, [pack_command(b"DEL", self._name(key))], 1, "discard"))

    def health(self) -> dict[str, bool]:
        """:class:`~kvdi.connectors.store.HealthStore`: the server, False while its circuit breaker is open."""
        return {str(self.node.label): self.node.breaker.state is not BreakerState.OPEN}

    def check(self) -> str:
        """Reach the server: not a cluster node, stores a probe, room for a frame; a summary, or ConfigError."""
        from kvdi.connectors.redis.probe import PROBE_TTL_S, check_single, probe_name

        info = pack_command(b"INFO", b"cluster") + pack_command(b"INFO", b"memory")
        exchange = self.node.run(Exchange(self.node, [info], 2, "check", bounds=INFO))

        def probe() -> list[object] | OSError | None:
            name, ttl = probe_name(self._prefix), str(PROBE_TTL_S).encode()
            packed = pack_command(b"SET", name, b"probe", b"EX", ttl) + pack_command(b"DEL", name)
            return self.node.run(Exchange(self.node, [packed], 2, "check")).result

        return check_single(exchange.result, self.url, probe, self.max_object_bytes)

    def close(self) -> None:
        """Close every pooled connection; the store must not be used afterwards."""
        self.node.client.close()
        self.node.client.connection_pool.disconnect()

    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    @overload
    def _replies(self, exchange: Exchange) -> list[object]: ...
    @overload
    def _replies(self, exchange: Exchange, miss: bool) -> list[object] | None: ...

    def _replies(self, exchange: Exchange, miss: bool = False) -> list[object] | None:
        """The exchange's replies; None when ``miss`` and the breaker refused the call; raises any other failure."""
        self.node.run(exchange)
        if miss and isinstance(exchange.result, BreakerOpenError):
            return None
        if isinstance(exchange.result, OSError):
            raise exchange.result
        assert exchange.result is not None
        return exchange.result
