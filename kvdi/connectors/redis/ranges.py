"""Bounded partial reads on Redis: ``get_range_into_many`` of the Redis stores (a canonical pack's sections).

A range read is ``STRLEN key`` then ``GETRANGE key offset offset+want-1`` per item, all pipelined in one
exchange per server (one round trip). The ``GETRANGE`` replies are read off the socket with a bound of
``want`` bytes each (:mod:`.bounded`), so a reader of part of a pack (a TP=2 rank of a TP=1 writer's pack)
receives its sections' bytes only, never the whole object, and they land straight in the pieces
(:class:`~.bounded.Placed`). The two commands are not a transaction: an object rewritten between them
answers a range of the wrong length, which is a miss (canonical objects are checked section by section
anyway, so a mixed read never loads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvdi.connectors.redis.bounded import Bounds, Placed
from kvdi.connectors.redis.exchange import Exchange, pack_command
from kvdi.connectors.redis.wire import redirected
from kvdi.connectors.store.blockio import scatter

if TYPE_CHECKING:
    from kvdi.connectors.redis.cluster import RedisClusterBlockStore
    from kvdi.connectors.redis.server import RedisBlockStore, RedisNode

RangeItem = tuple[bytes, int, Sequence[memoryview]]
"""A range read: the block key, the offset of the first byte, the pieces the bytes are read into."""


def wanted(pieces: Sequence[memoryview]) -> int:
    """The bytes a range read fills: the pieces' sizes summed."""
    return sum(p.nbytes for p in pieces)


def range_exchange(node: RedisNode, names: Sequence[bytes], items: Sequence[RangeItem]) -> Exchange:
    """``STRLEN`` + ``GETRANGE`` per item (``names[i]`` the Redis key of ``items[i]``), replies bounded to each
    range's size in all (read them with :func:`range_sizes`)."""

    packed, targets, most, total = bytearray(), [], 0, 0
    for name, (_, offset, pieces) in zip(names, items, strict=True):
        want = wanted(pieces)
        # GETRANGE's end is inclusive; "1 0" is an empty range (an end of -1 would mean the whole value)
        first, last = (offset, offset + want - 1) if want else (1, 0)
        packed += pack_command(b"STRLEN", name)
        packed += pack_command(b"GETRANGE", name, str(max(first, 0)).encode(), str(max(last, 0)).encode())
        targets += [(), pieces]
        most, total = max(most, want), total + want
    bounds = Bounds(value=most, total=total)
    return Exchange(node, [bytes(packed)], 2 * len(items), "get_range_into_many", bounds=bounds, targets=targets)


def server_ranges(store: RedisBlockStore, items: Sequence[RangeItem]) -> list[int | None]:
    """``RedisBlockStore.get_range_into_many``: bytes from an offset into pieces when the object holds them, in one
    round trip; each object's size, None where absent, unreadable or the server failed (never raises)."""
    if not items:
        return []
    exchange = store.node.run(range_exchange(store.node, [store._name(k) for k, _, _ in items], items))
    return range_sizes(exchange.result, items) if isinstance(exchange.result, list) else [None] * len(items)


def cluster_ranges(store: RedisClusterBlockStore, items: Sequence[RangeItem]) -> list[int | None]:
    """``RedisClusterBlockStore.get_range_into_many``: :func:`server_ranges` batched per node as its reads are;
    None where absent or the key's node failed."""
    sizes: list[int | None] = [None] * len(items)

    def make(node: RedisNode, names: list[bytes], index: list[int]) -> Exchange:
        return range_exchange(node, names, [items[i] for i in index])

    for exchange, index in store._run([key for key, _, _ in items], True, make):
        if isinstance(exchange.result, list):
            for i, size in zip(index, range_sizes(exchange.result, [items[i] for i in index]), strict=True):
                sizes[i] = size
    return sizes


def range_sizes(replies: Sequence[object], items: Sequence[RangeItem]) -> list[int | None]:
    """Each item's object size from an exchange of :func:`range_exchange` (its pieces filled when the object holds
    the range); None where absent, redirected, cut short or answered a range of the wrong length."""
    return [range_size(replies[2 * i], replies[2 * i + 1], item) for i, item in enumerate(items)]


def range_size(length: object, value: object, item: RangeItem) -> int | None:
    """One item's size from its ``STRLEN`` and ``GETRANGE`` replies (see :func:`range_sizes`)."""
    _, offset, pieces = item
    if isinstance(length, Exception):  # WRONGTYPE: a key that holds no string, an odd object (a redirect: a miss)
        return None if redirected(length) else 0
    if type(length) is not int or length <= 0 or offset < 0:
        return None
    want = wanted(pieces)
    if offset + want > length:  # the object does not hold the range: its size, the pieces untouched
        return None if isinstance(value, Placed) else length  # (placed anyway: it grew between the commands)
    if isinstance(value, Placed):
        return length if int(value) == want else None
    if want == 0:
        return length
    if isinstance(value, bytes | bytearray) and len(value) == want:
        scatter(value, pieces)  # only when the socket's bytes could not land in place (never on this reader)
        return length
    return None  # cut, not a string, or shorter than asked: rewritten between the two commands


__all__ = ["RangeItem", "cluster_ranges", "range_exchange", "range_size", "range_sizes", "server_ranges", "wanted"]
