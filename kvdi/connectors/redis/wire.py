"""RESP on the wire for the Redis stores: packed ``SET`` batches, gathered sends, reply checks.

Saves are packed here so that a frame's pieces (header, then per-layer views of the paged
cache) reach the socket uncopied, in one gathered ``sendmsg`` per batch on plain TCP / unix
sockets. Replies are checked here too: a store is hostile input, so a reply of the wrong
type is never trusted, only classified.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError

from kvdi.connectors.redis.bounded import Placed
from kvdi.connectors.store.blockio import scatter
from kvdi.connectors.store.framing import Buffer
from kvdi.masking import mask_text

if TYPE_CHECKING:
    from kvdi.connectors.store.codec import Compressor

E = TypeVar("E")

_COALESCE_BYTES = 16 << 10  # pieces up to this size are copied into the command buffer
_IOV_BATCH = 512  # buffers per sendmsg call, below every platform's IOV_MAX
BAD_OBJECT = b""
"""What a read returns for a key whose reply is not a string (wrong type, error reply): never
a valid frame, so the worker half counts it as corrupt and drops the key."""


REDIRECTS = (MovedError, AskError, TryAgainError, ClusterDownError)
"""Error replies that say "not here, not now" (a cluster's slot moved or is migrating): a miss, and a
sign the caller's slot map is stale, never a bad object."""


def redirected(reply: object) -> bool:
    """Whether a reply is one of :data:`REDIRECTS`."""
    return isinstance(reply, REDIRECTS)


def present(reply: object) -> bool:
    """Whether a ``STRLEN`` reply says the key holds a non-empty object.

    An error reply (``WRONGTYPE``: the key holds a list, a hash...) counts as present, so
    the load that follows reads it as a bad object and drops it instead of the key
    poisoning its prompt's prefix for good. Anything else not a positive integer is absent.
    """
    if isinstance(reply, Exception):
        return not redirected(reply)
    return type(reply) is int and reply > 0


def object_or_none(reply: object, limit: int | None) -> Buffer | None:
    """A ``GET`` / ``GETRANGE`` reply as an object: bytes (at most ``limit + 1``), None when absent, else BAD_OBJECT.

    ``GETRANGE`` answers an absent key with an empty string, so an empty reply is absent.
    A reply longer than ``limit + 1`` (a server that ignored the range) is cut: it is not a
    frame either way, and the cut keeps what the caller holds bounded.
    """
    if reply is None or reply == b"" or redirected(reply):
        return None
    if isinstance(reply, bytes | bytearray):
        return reply if limit is None or len(reply) <= limit + 1 else bytes(reply[: limit + 1])
    return BAD_OBJECT


def placed_size(reply: object, limit: int | None, pieces: Sequence[memoryview]) -> int | None:
    """A ``GET`` / ``GETRANGE`` reply read for ``pieces``: the object's size, or None when absent.

    A :class:`~.bounded.Placed` is a value already read into ``pieces`` (:func:`~.bounded.read_replies`). A
    value read into a buffer of its own is copied into ``pieces`` when the sizes match, else left
    alone; a reply that is not a string is an object of size 0 (the worker counts it as corrupt).
    """
    if isinstance(reply, Placed):
        return int(reply)
    obj = object_or_none(reply, limit)
    if obj is None:
        return None
    size = memoryview(obj).nbytes
    if size and size == sum(p.nbytes for p in pieces):
        scatter(obj, pieces)
    return size


def written(reply: object) -> bool:
    """Whether a ``SET`` reply says the object was stored (``+OK``; redis-py may have parsed it to True)."""
    return reply is True or (isinstance(reply, str | bytes) and reply in (b"OK", "OK"))


def pack_sets(prefix: bytes, items: Sequence[tuple[bytes, Sequence[Buffer]]], ttl_s: int | None) -> list[Buffer]:
    """RESP for ``SET prefix+hex(key) <pieces joined> [EX ttl_s]`` per item, large pieces left uncopied."""
    argc, tail = (b"*5", b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s)) if ttl_s else (b"*3", b"\r\n")
    chunks: list[Buffer] = []
    small = bytearray()  # small parts coalesce into one buffer: fewer sendall calls
    for key, pieces in items:
        name = prefix + key.hex().encode()
        views = [byte_view(p) for p in pieces]
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


def send_gathered(sock: socket.socket, chunks: Sequence[Buffer], deadline: float | None = None) -> None:
    """Send every chunk, in order, with as few ``sendmsg`` calls as the kernel allows (handles partial sends);
    all of it by ``deadline`` (a ``time.monotonic()`` instant) when given, else TimeoutError: a server that
    reads slowly cannot hold a save past its deadline one accepted byte at a time."""
    views = [memoryview(c) for c in chunks]  # byte views (see _byte_view): slicing counts bytes
    saved = sock.gettimeout()
    try:
        _send_views(sock, views, deadline, saved)
    finally:
        if deadline is not None:
            sock.settimeout(saved)


def _send_views(sock: socket.socket, views: list[memoryview], deadline: float | None, timeout: float | None) -> None:
    i = 0
    while i < len(views):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request was not sent whole within the operation's deadline")
            sock.settimeout(left if timeout is None else min(left, timeout))
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


def byte_view(piece: Buffer) -> memoryview:
    view = memoryview(piece)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    # A view's len() counts elements: make every view count bytes.
    return view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")


def describe(exc: BaseException) -> str:
    # redis-py messages name host:port, never credentials, but be safe about URLs.
    return mask_text(str(exc) or type(exc).__name__)


def describe_reply(reply: object) -> str:
    """A reply that is not what the exchange expected, in words (an error's masked message, else its type)."""
    return describe(reply) if isinstance(reply, BaseException) else f"unexpected reply of type {type(reply).__name__}"


def run_timed(run: Callable[[E], E], exchange: E, compressor: Compressor | None) -> E:
    """``run(exchange)`` (a write); with a compressor, it is told the bytes sent and the seconds the exchange took
    (``compression=auto`` weighs the codec against this link's measured speed). Failed exchanges tell nothing."""
    if compressor is None:
        return run(exchange)
    started = time.perf_counter()
    done = run(exchange)
    if not isinstance(getattr(done, "result", None), OSError):
        sent = sum(memoryview(chunk).nbytes for chunk in getattr(exchange, "chunks", ()))
        compressor.link_sample(sent, time.perf_counter() - started)
    return done
