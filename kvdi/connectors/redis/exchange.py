"""One server's share of a Redis batch (:class:`Exchange`) and RESP packing: what :mod:`.server`, :mod:`.cluster`,
:mod:`.ranges` and ``kvdi store`` send through :class:`~.server.RedisNode`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvdi.connectors.redis.bounded import SMALL, Bounds
from kvdi.connectors.store.framing import Buffer

if TYPE_CHECKING:
    from kvdi.connectors.redis.server import RedisNode


def pack_command(*args: bytes) -> bytes:
    """One command in RESP (arguments already bytes)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


@dataclass
class Exchange:
    """One server's share of a batch: packed commands out, raw replies (or the failure) back."""

    node: RedisNode
    chunks: list[Buffer]
    replies: int
    op: str
    bounds: Bounds = SMALL  # what each reply may hold (:mod:`.bounded`): small integer / status replies by default
    targets: Sequence[Sequence[memoryview]] | None = None  # where each value of that size is read into (reads)
    result: list[object] | OSError | None = None
    deadline: float = 0.0  # when the whole exchange (send and every reply) must be done, set by :meth:`RedisNode.send`
    _conn: Any = field(default=None, repr=False)


__all__ = ["Exchange", "pack_command"]
