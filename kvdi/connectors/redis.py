"""Redis backend: one Redis key per framed block, behind a circuit breaker.

:func:`open_store` is the ``backend`` target of the ``redis`` connector spec; the generic
halves in :mod:`kvdi.connectors.store` do the rest. Each block is one key
(``key_prefix`` + hex of the block key) written with a single ``SET`` (``EX`` when
``ttl_s`` is set), so a reader sees a whole object or nothing. Batches travel in one
pipeline (one round trip), never in a transaction. Saves are packed here so that a frame's
pieces (header, then per-layer views of the paged cache) reach the socket uncopied, in one
gathered ``sendmsg`` per batch on plain TCP / unix sockets.

A dead or hung server costs a miss, not a stall: every call is bounded by
``connect_timeout_s`` / ``op_timeout_s`` and never retried, and after
``breaker_failures`` consecutive failures the store stops calling the server for
``breaker_reset_s`` (reads answer as misses, writes raise :class:`ConnectionError` at
once). After that one call probes the server again (half-open) and closes the breaker
when it succeeds. Failures surface as builtin :class:`ConnectionError` /
:class:`TimeoutError` / :class:`OSError` (redis-py's own exceptions are not OSErrors),
and the URL's password is shown as ``***`` everywhere.

This is the only kvdi module that imports ``redis``.
"""

from __future__ import annotations

import enum
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvdi.connectors.store import Buffer
from kvdi.errors import ConfigError
from kvdi.masking import mask_text, mask_url

if TYPE_CHECKING:
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import KvdiSettings, RedisSettings

logger = logging.getLogger(__name__)

_COALESCE_BYTES = 16 << 10  # pieces up to this size are copied into the command buffer
_IOV_BATCH = 512  # buffers per sendmsg call, below every platform's IOV_MAX


class BreakerState(enum.Enum):
    """Circuit breaker states: calls go through (closed), are refused (open), or one probe runs (half-open)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Counts consecutive failures; opens after ``failures`` of them for ``reset_s``, then lets one probe through.

    Thread-safe. ``clock`` is injectable so the policy can be tested without sleeping.
    """

    def __init__(self, failures: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = failures
        self.reset_s = reset_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        """The current state (an open breaker whose reset time passed still reads OPEN until probed)."""
        return self._state

    def allow(self) -> bool:
        """True when the caller may call the server; the first caller after the reset time becomes the probe."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.reset_s:
                self._state = BreakerState.HALF_OPEN
                return True
            return False

    def record_success(self) -> bool:
        """Note a call that reached the server; True when this closed an open or half-open breaker."""
        with self._lock:
            was_tripped = self._state is not BreakerState.CLOSED
            self._state = BreakerState.CLOSED
            self._failures = 0
            return was_tripped

    def release_probe(self) -> None:
        """End a probe that neither reached nor failed to reach the server: back to OPEN, probe again later."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                self._state = BreakerState.OPEN
                self._opened_at = self._clock() - self.reset_s

    def record_failure(self) -> bool:
        """Note a failed call; True when this (re)opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self._failures >= self.threshold
            ):
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                self.times_opened += 1
                return True
            return False


class RedisBlockStore:
    """A :class:`~kvdi.connectors.store.BlockStore` over one Redis server; safe to share across threads."""

    def __init__(self, options: RedisSettings) -> None:
        raw_url = options.url.get_secret_value()
        self.url = mask_url(raw_url)
        self.key_prefix = options.key_prefix
        self.ttl_s = options.ttl_s
        self._prefix = options.key_prefix.encode()
        self.breaker = CircuitBreaker(options.breaker_failures, options.breaker_reset_s)
        try:
            self._client: redis.Redis = redis.Redis.from_url(
                raw_url,
                socket_connect_timeout=options.connect_timeout_s,
                socket_timeout=options.op_timeout_s,
                # No retries: a retry on a dead server doubles the stall the breaker exists to bound.
                retry=Retry(NoBackoff(), 0),
                retry_on_error=[],
                health_check_interval=0,
            )
        except (ValueError, redis.RedisError) as exc:
            # redis-py's parse errors may quote the URL; show only the masked one.
            raise ConfigError(
                f"redis.url (KVDI_REDIS__URL={self.url}) cannot be used: {type(exc).__name__}; "
                "expected redis://[[user]:password@]host[:port][/db], rediss://... or unix:///path"
            ) from None

    def __repr__(self) -> str:
        return f"RedisBlockStore(url={self.url!r}, key_prefix={self.key_prefix!r}, breaker={self.breaker.state.value})"

    # BlockStore protocol

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, exist (one pipelined EXISTS per key); 0 while the breaker is open."""
        if not keys:
            return 0
        if not self.breaker.allow():
            return 0
        with self._calling("count_prefix"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            present = pipe.execute()
        count = 0
        for hit in present:
            if not hit:
                break
            count += 1
        return count

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Each key's framed object or None (one pipelined GET per key); all None while the breaker is open."""
        if not keys:
            return []
        if not self.breaker.allow():
            return [None] * len(keys)
        with self._calling("get_many"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self._name(key))
            values: list[Buffer | None] = pipe.execute()
        return values

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> None:
        """One ``SET`` per object (``EX`` when ``ttl_s``) in one pipeline; raises ConnectionError while open.

        The commands are packed here rather than by redis-py's pipeline so that an object's
        pieces (frame header, then the cache's per-layer views) go to the socket as they are:
        joining them first would copy every byte once more.
        """
        if not items:
            return
        self._refuse_if_open("put_many")
        with self._calling("put_many"):
            self._send_and_check(_pack_sets(self._prefix, items, self.ttl_s), len(items))

    def discard(self, key: bytes) -> None:
        """``DEL`` one key (absent keys are fine); raises ConnectionError while the breaker is open."""
        self._refuse_if_open("discard")
        with self._calling("discard"):
            self._client.delete(self._name(key))

    def close(self) -> None:
        """Close every pooled connection; the store must not be used afterwards."""
        self._client.close()
        self._client.connection_pool.disconnect()

    # internals

    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _send_and_check(self, chunks: list[Buffer], replies: int) -> None:
        """Send packed commands on one pooled connection, read every reply, raise the first error reply."""
        pool: Any = self._client.connection_pool
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py < 5.3 wants a command name
            conn = pool.get_connection("SET")
        first_error: redis.ResponseError | None = None
        try:
            sock = getattr(conn, "_sock", None)
            if type(sock) is socket.socket and hasattr(sock, "sendmsg"):
                # One gathered syscall for many pieces instead of one sendall each: measurably
                # faster when an I/O thread shares the GIL with framing. TLS sockets (a
                # subclass) and platforms without sendmsg take redis-py's own path.
                send_gathered(sock, chunks)
            else:
                conn.send_packed_command(chunks, check_health=False)
            for _ in range(replies):
                try:
                    conn.read_response()
                except redis.ResponseError as exc:
                    first_error = first_error or exc
        except BaseException:
            conn.disconnect()  # a half-sent or half-read pipeline leaves the socket out of step
            raise
        finally:
            pool.release(conn)
        if first_error is not None:
            raise first_error

    def _refuse_if_open(self, op: str) -> None:
        if not self.breaker.allow():
            raise ConnectionError(
                f"redis at {self.url}: {op} refused, circuit breaker open after "
                f"{self.breaker.threshold} consecutive failures (retrying after {self.breaker.reset_s}s)"
            )

    @contextmanager
    def _calling(self, op: str) -> Iterator[None]:
        """Run one server call: feed the breaker and turn redis-py errors into builtin OSErrors."""
        try:
            yield
        except (redis.TimeoutError, TimeoutError) as exc:
            self._failed(op, exc)
            raise TimeoutError(f"redis at {self.url}: {op} timed out ({_describe(exc)})") from None
        except (redis.ConnectionError, OSError) as exc:  # also AuthenticationError, raw socket errors
            self._failed(op, exc)
            raise ConnectionError(f"redis at {self.url}: {op} failed ({_describe(exc)})") from None
        except redis.RedisError as exc:
            # The server answered (e.g. OOM, READONLY): it is alive, so the breaker closes.
            self._succeeded()
            raise OSError(f"redis at {self.url}: {op} rejected by the server ({_describe(exc)})") from None
        except BaseException:
            # Not the server's fault (e.g. a bad argument), but a probe must not leave the breaker half-open.
            self.breaker.release_probe()
            raise
        self._succeeded()

    def _succeeded(self) -> None:
        if self.breaker.record_success():
            logger.info("redis at %s answers again: circuit breaker closed", self.url)

    def _failed(self, op: str, exc: BaseException) -> None:
        # Drop pooled sockets: after a server restart they are all dead, and reusing one
        # would fail the half-open probe.
        self._client.connection_pool.disconnect()
        if self.breaker.record_failure():
            logger.warning(
                "redis at %s: %s failed (%s); circuit breaker open for %ss: loads miss, saves fail fast",
                self.url,
                op,
                _describe(exc),
                self.breaker.reset_s,
            )


def _pack_sets(prefix: bytes, items: Sequence[tuple[bytes, Sequence[Buffer]]], ttl_s: int | None) -> list[Buffer]:
    """RESP for ``SET prefix+hex(key) <pieces joined> [EX ttl_s]`` per item, large pieces left uncopied."""
    argc, tail = (b"*5", b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s)) if ttl_s else (b"*3", b"\r\n")
    chunks: list[Buffer] = []
    small = bytearray()  # small parts coalesce into one buffer: fewer sendall calls
    for key, pieces in items:
        name = prefix + key.hex().encode()
        views = [_byte_view(p) for p in pieces]
        size = sum(v.nbytes for v in views)
        small += b"%s\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(name), name, size)
        for view in views:
            if view.nbytes <= _COALESCE_BYTES:
                small += view
            else:
                if small:
                    chunks.append(bytes(small))
                    small.clear()
                chunks.append(view)
        small += tail
    chunks.append(bytes(small))
    return chunks


def send_gathered(sock: socket.socket, chunks: Sequence[Buffer]) -> None:
    """Send every chunk, in order, with as few ``sendmsg`` calls as the kernel allows (handles partial sends)."""
    views = [memoryview(c) for c in chunks]  # byte views (see _byte_view): slicing counts bytes
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV_BATCH])
        while sent and i < len(views):
            size = views[i].nbytes
            if sent >= size:
                sent -= size
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
        while i < len(views) and views[i].nbytes == 0:
            i += 1


def _byte_view(piece: Buffer) -> memoryview:
    view = memoryview(piece)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    # A view's len() counts elements: make every view count bytes.
    return view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")


def _describe(exc: BaseException) -> str:
    # redis-py messages name host:port, never credentials, but be safe about URLs.
    return mask_text(str(exc) or type(exc).__name__)


def open_store(options: RedisSettings, layout: KVCacheSpec, settings: KvdiSettings) -> RedisBlockStore:
    """The ``redis`` connector's backend: a store over the server named by ``KVDI_REDIS__URL`` (connects lazily)."""
    del layout, settings  # keys are already seeded with the layout fingerprint
    return RedisBlockStore(options)
