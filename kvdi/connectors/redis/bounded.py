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

Only what a ``GET`` / ``GETRANGE`` can answer is understood: a bulk string, a null (``$-1``
or RESP3 ``_``), an error line (parsed into redis-py's exception classes, so cluster
redirections stay recognisable) and single-line values of the wrong type; an aggregate
(``*``, ``%``, ...) is read as a bad object and also ends the batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from redis._parsers.base import BaseParser

MAX_LINE = 64 << 10
"""The longest reply line (a length or an error message) read before the reply counts as oversized."""
_RECV = 64 << 10


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


class CutReplies(Exception):
    """The batch was cut: ``replies`` holds one entry per command (misses after the cut); ``why`` says where."""

    def __init__(self, replies: list[object], why: str) -> None:
        super().__init__(why)
        self.replies = replies
        self.why = why


class _Garbled(Exception):
    pass


class _Reader:
    def __init__(self, sock: Any, bound: int, timeout_s: float) -> None:
        self.sock = sock
        self.bound = bound
        self.timeout_s = timeout_s
        self.buf = bytearray()
        self.pos = 0
        self.deadline = 0.0

    def _wait(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"a reply did not arrive whole within {self.timeout_s}s")
        self.sock.settimeout(min(left, self.timeout_s))

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
            if len(self.buf) - self.pos > MAX_LINE:
                raise _Cut(OVERSIZED, f"a reply line longer than {MAX_LINE} B")
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

    def reply(self, target: Sequence[memoryview] | None = None) -> object:
        self.deadline = time.monotonic() + self.timeout_s
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
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
            if target is not None and size and size == sum(v.nbytes for v in target):
                self.into(target)
                return Placed(size)
            return self.exact(size)
        if kind == b"_":
            return None
        if kind == b"-":
            return BaseParser.parse_error(rest.decode("utf-8", "replace"))  # type: ignore[no-untyped-call]
        if kind in (b":", b"+", b",", b"#", b"("):
            return WRONG_TYPE
        raise _Cut(WRONG_TYPE, f"an aggregate or unknown reply type {kind!r}")


class _Cut(Exception):
    def __init__(self, reply: object, why: str) -> None:
        super().__init__(why)
        self.reply = reply
        self.why = why


def read_replies(
    sock: Any, count: int, bound: int, timeout_s: float, targets: Sequence[Sequence[memoryview]] | None = None
) -> list[object]:
    """``count`` replies read off ``sock`` with at most ``bound`` bytes of value each.

    With ``targets`` (one list of byte views per reply), a value of exactly a target's size is read
    into it and answered by its size (:class:`Placed`); the target may be partly written when the read fails.

    Raises :class:`CutReplies` (with every reply up to and including the cut one, misses after it)
    when a reply was oversized, of an aggregate type or left bytes behind it: the caller drops the
    connection. Raises ConnectionError / TimeoutError / OSError when the stream broke.
    """
    reader = _Reader(sock, bound, timeout_s)
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


__all__ = ["MAX_LINE", "OVERSIZED", "WRONG_TYPE", "CutReplies", "Placed", "read_replies"]
