"""Reading the replies of a read batch off the socket with a bound, whatever the server claims.

``GETRANGE key 0 limit`` bounds a value only on a server that honours the range; redis-py then
reads whatever length the reply announces, so a hostile server (or anything else answering on
the port) could make one load cost hundreds of MiB. :func:`read_replies` parses the replies of a
read batch itself, straight off the socket: a bulk string is read into one buffer of its
announced size only when that size is at most ``bound`` (one frame); a longer one is never
read: it is answered :data:`OVERSIZED` (a bad object: the worker counts it as corrupt and
drops the key), the remaining replies of the batch are misses, and the connection is dropped
(:class:`CutReplies`), since the stream can no longer be trusted. Each reply must arrive
whole within ``timeout_s``, so a server that trickles bytes cannot hold a load either.

Given a target per reply (the pieces a frame is loaded into: its header, then the paged cache's
per-layer views), a bulk string of exactly the target's size is read off the socket straight into
it, with no buffer of its own, and answered by its size (:class:`Placed`); any other length is read into a
buffer as above, leaving the target untouched.

Every exchange of the Redis stores and of ``kvdi store`` goes through this reader, each with a
bound fitting the reply it expects (:class:`Bounds`): one frame for reads, a few bytes of value
and a short line for integer and status replies (``STRLEN``, ``SET``, ``DEL``), a page of names
for ``SCAN``. The whole exchange (every reply of the batch) must arrive within ``timeout_s``: an
overall deadline per operation, not per receive, so replies trickled just under a socket timeout
cannot add up either.

Understood: a bulk string, a null (``$-1`` or RESP3 ``_``), an error line (parsed into
redis-py's exception classes, so cluster redirections stay recognisable), an integer (an ``int``),
a status (:class:`Status`), other single-line values (:data:`WRONG_TYPE`) and, where the bounds
allow items, arrays of those (a ``list``); any other aggregate (``%``, ``~``, ...) or an array
where none is expected is read as a bad object and ends the batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis._parsers.base import BaseParser

MAX_LINE = 64 << 10
"""The longest reply line (a length or an error message) read before the reply counts as oversized."""
_RECV = 64 << 10
LATE_S = 0.25
"""Past an exchange's deadline, replies already received are still read for this long (1 ms per receive at most):
a cluster batch reads its nodes one after the other, and a node that hung must not fail the ones that answered."""


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


OVERSIZED: Any = _Marker("OVERSIZED")
"""The reply that was longer than the bound (not a string: classified as a bad object)."""
WRONG_TYPE: Any = _Marker("WRONG_TYPE")
"""A single-line reply that is not a string (an integer, a status, a double...)."""


class Placed(int):
    """The reply for a value read straight into its target: its size (never what a server's integer reply parses to)."""


class Status(str):
    """A status reply (``+OK``, ``+PONG``): equal to its text, never taken for a value."""

    __slots__ = ()


@dataclass(frozen=True)
class Bounds:
    """What one exchange's replies may hold: ``value`` bytes per bulk string, ``line`` bytes per reply line,
    ``items`` elements per array (0: no arrays), ``total`` bytes of bulk strings in all (None: ``value`` each)."""

    value: int
    line: int = MAX_LINE
    items: int = 0
    total: int | None = None


SMALL = Bounds(value=0, line=1024)
"""Integer and status replies (``STRLEN``, ``EXISTS``, ``SET``, ``DEL``): no value bytes at all, a short line."""
INFO = Bounds(value=64 << 10)
"""``INFO <section>``: one bulk string of a few KiB."""
SCAN = Bounds(value=4096, line=1024, items=4096, total=4 << 20)
"""``SCAN``: a cursor and a page of names (``COUNT`` ~1000), each at most 4 KiB, 4 MiB in all."""


class CutReplies(Exception):
    """The batch was cut: ``replies`` holds one entry per command (misses after the cut); ``why`` says where."""

    def __init__(self, replies: list[object], why: str) -> None:
        super().__init__(why)
        self.replies = replies
        self.why = why


class _Garbled(Exception):
    pass


class _Reader:
    def __init__(self, sock: Any, bounds: Bounds, timeout_s: float, deadline: float | None) -> None:
        self.sock = sock
        self.bound = bounds.value
        self.bounds = bounds
        self.timeout_s = timeout_s
        self.buf = bytearray()
        self.pos = 0
        self.deadline = time.monotonic() + timeout_s if deadline is None else deadline
        self.budget = bounds.total

    def _wait(self) -> None:
        left = self.deadline - time.monotonic()
        if left > 0:
            self.sock.settimeout(min(left, self.timeout_s))
        elif left > -LATE_S:  # past the deadline: only bytes already here (a batch's other nodes answered while
            self.sock.settimeout(0.001)  # one hung), for at most LATE_S more
        else:
            raise TimeoutError(f"the replies did not arrive whole within {self.timeout_s}s")

    def _more(self) -> None:
        self._wait()
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        chunk = self.sock.recv(_RECV)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        self.buf += chunk

    def line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                line = bytes(self.buf[self.pos : end])
                self.pos = end + 2
                return line
            if len(self.buf) - self.pos > self.bounds.line:
                raise _Cut(OVERSIZED, f"a reply line longer than {self.bounds.line} B")
            self._more()

    def exact(self, n: int) -> bytearray:
        """``n`` bytes and the CRLF after them, read straight into one buffer."""
        out = bytearray(n)
        self.into((memoryview(out),))
        return out

    def into(self, views: Sequence[memoryview]) -> None:
        """Fill ``views`` in order (as many bytes as they hold), then read the CRLF after them."""
        for view in views:
            have = min(view.nbytes, len(self.buf) - self.pos)
            view[:have] = self.buf[self.pos : self.pos + have]
            self.pos += have
            while have < view.nbytes:
                self._wait()
                got = self.sock.recv_into(view[have:], view.nbytes - have)
                if not got:
                    raise ConnectionError("the server closed the connection")
                have += got
        self._crlf()

    def _crlf(self) -> None:
        while len(self.buf) - self.pos < 2:
            self._more()
        if self.buf[self.pos : self.pos + 2] != b"\r\n":
            raise _Garbled("a bulk string not followed by CRLF")
        self.pos += 2

    def reply(self, target: Sequence[memoryview] | None = None, depth: int = 0) -> object:
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind in (b"$", b"="):  # a bulk string, or RESP3's verbatim string (``txt:`` then the text)
            try:
                size = int(rest)
            except ValueError:
                raise _Garbled(f"bulk length {rest[:20]!r}") from None
            if size == -1:
                return None
            if size < 0:
                raise _Garbled(f"bulk length {size}")
            if size > self.bound:
                raise _Cut(OVERSIZED, f"a value of {size} B announced, at most {self.bound} B read per object")
            if self.budget is not None:
                self.budget -= size
                if self.budget < 0:
                    raise _Cut(OVERSIZED, f"values of more than {self.bounds.total} B in one exchange")
            if kind == b"$" and target is not None and size and size == sum(v.nbytes for v in target):
                self.into(target)
                return Placed(size)
            value = self.exact(size)
            return value if kind == b"$" else value[4:]
        if kind == b"_":
            return None
        if kind == b"-":
            return BaseParser.parse_error(rest.decode("utf-8", "replace"))  # type: ignore[no-untyped-call]
        if kind == b":":
            try:
                return int(rest)
            except ValueError:
                raise _Garbled(f"integer {rest[:20]!r}") from None
        if kind == b"+":
            return Status(rest.decode("utf-8", "replace"))
        if kind in (b",", b"#", b"("):
            return WRONG_TYPE
        if kind == b"*" and self.bounds.items and depth < 2:
            try:
                count = int(rest)
            except ValueError:
                raise _Garbled(f"array length {rest[:20]!r}") from None
            if count > self.bounds.items:
                raise _Cut(OVERSIZED, f"an array of {count} items announced, at most {self.bounds.items} read")
            return None if count < 0 else [self.reply(None, depth + 1) for _ in range(count)]
        raise _Cut(WRONG_TYPE, f"an aggregate or unknown reply type {kind!r}")


class _Cut(Exception):
    def __init__(self, reply: object, why: str) -> None:
        super().__init__(why)
        self.reply = reply
        self.why = why


def read_replies(
    sock: Any,
    count: int,
    bound: int | Bounds,
    timeout_s: float,
    targets: Sequence[Sequence[memoryview]] | None = None,
    deadline: float | None = None,
) -> list[object]:
    """``count`` replies read off ``sock`` with at most ``bound`` bytes of value each (or within ``Bounds``), all
    of them by ``deadline`` (a ``time.monotonic()`` instant; default: ``timeout_s`` from now).

    With ``targets`` (one list of byte views per reply), a value of exactly a target's size is read
    into it and answered by its size (:class:`Placed`); the target may be partly written when the read fails.

    Raises :class:`CutReplies` (with every reply up to and including the cut one, misses after it)
    when a reply was oversized, of an aggregate type or left bytes behind it: the caller drops the
    connection. Raises ConnectionError / TimeoutError / OSError when the stream broke.
    """
    reader = _Reader(sock, bound if isinstance(bound, Bounds) else Bounds(bound), timeout_s, deadline)
    saved = sock.gettimeout()
    replies: list[object] = []
    try:
        for i in range(count):
            try:
                replies.append(reader.reply(None if targets is None else targets[i]))
            except _Cut as cut:
                replies.append(cut.reply)
                replies.extend([None] * (count - len(replies)))
                raise CutReplies(replies, cut.why) from None
            except _Garbled as exc:
                raise OSError(f"a garbled reply ({exc})") from None
    finally:
        sock.settimeout(saved)
    if reader.pos != len(reader.buf):  # bytes nobody asked for: the stream is out of step
        raise CutReplies(replies, f"{len(reader.buf) - reader.pos} B after the last reply")
    return replies


__all__ = [
    "INFO",
    "MAX_LINE",
    "OVERSIZED",
    "SCAN",
    "SMALL",
    "WRONG_TYPE",
    "Bounds",
    "CutReplies",
    "Placed",
    "Status",
    "read_replies",
]
