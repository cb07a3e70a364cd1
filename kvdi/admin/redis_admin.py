"""Administration of the ``redis`` store on one server or a Redis Cluster (every master, one group each).

Objects are the keys ``key_prefix`` + 32 hex digits, found with ``SCAN MATCH`` (never
``KEYS``: a large store is walked in steps without blocking the server); sizes come from
``STRLEN`` and the last write-or-use time from ``OBJECT IDLETIME``, pipelined per batch. A key
under the prefix with another name is counted as other and never touched; one of another type
(a list, a hash) under an object's name is odd (foreign: never removed). Every exchange goes
through the store's own bounded reader (:mod:`kvdi.connectors.redis.bounded`) with a bound
fitting its reply (a page of names, integers, at most the bytes asked of a ``GETRANGE``) and
under one deadline (``op_timeout_s``) each, so a hostile server costs neither memory nor time.

An empty ``key_prefix`` is refused: with it every key of the database would look like a
candidate, and an administration command must never walk, let alone remove, another
application's keys.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import redis
from redis.cluster import RedisCluster

from kvdi.admin.model import StoreObject, is_key_name
from kvdi.connectors.redis.bounded import INFO, SCAN, SMALL, Bounds
from kvdi.connectors.redis.breaker import CircuitBreaker
from kvdi.connectors.redis.server import Exchange, RedisNode, client_options, pack_command
from kvdi.errors import ConfigError
from kvdi.masking import mask_url

if TYPE_CHECKING:
    from kvdi.settings import RedisSettings

_BATCH = 500


def _glob_escape(text: bytes) -> bytes:
    out = bytearray()
    for byte in text:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


def _name(node: Any) -> str:
    return str(node.name)


def _replies(node: RedisNode, commands: Sequence[bytes], op: str, bounds: Bounds) -> list[object]:
    """One pipelined exchange on ``node``; raises the node's failure (the CLI shows it as one line)."""
    exchange = node.run(Exchange(node, [b"".join(commands)], len(commands), op, bounds=bounds))
    if isinstance(exchange.result, OSError):
        raise exchange.result
    assert exchange.result is not None
    return exchange.result


class RedisStoreAdmin:
    """A :class:`~kvdi.admin.model.StoreAdmin` over the server or cluster ``options.url`` names."""

    def __init__(self, options: RedisSettings) -> None:
        if not options.key_prefix:
            raise ConfigError(
                "KVDI_REDIS__KEY_PREFIX='': kvdi store lists and removes only keys under a non-empty prefix "
                "(an empty one would take in every key of the database); set it to the prefix the engines "
                "write under (default 'kvdi:')"
            )
        raw = options.url.get_secret_value()
        self._prefix = options.key_prefix.encode()
        self.kind = "redis cluster" if options.cluster else "redis"
        self.where = f"{mask_url(raw)} key_prefix={options.key_prefix!r}"
        self._other = 0
        self._ttls: list[int] = []  # the listed objects' remaining lives in ms (-1: none), as the server says
        self._cluster: RedisCluster | None = None
        self._clients: list[Any] = []

        def node(client: Any, label: str) -> RedisNode:
            self._clients.append(client)
            return RedisNode(client, label, CircuitBreaker(options.breaker_failures, options.breaker_reset_s))

        if options.cluster:
            self._cluster = RedisCluster.from_url(raw, require_full_coverage=False, **client_options(options))
            primaries = self._cluster.get_primaries()  # type: ignore[no-untyped-call]
            self._nodes: list[tuple[str, RedisNode]] = [
                (p.name, node(self._cluster.get_redis_connection(p), f"cluster node {p.name}"))
                for p in sorted(primaries, key=_name)
            ]
        else:
            client = redis.Redis.from_url(raw, **client_options(options))
            self._nodes = [(mask_url(raw), node(client, mask_url(raw)))]
            _replies(self._nodes[0][1], [pack_command(b"PING")], "ping", SMALL)  # unreachable: an error now

    def objects(self) -> Iterator[StoreObject]:
        self._other = 0
        self._ttls = []
        match = _glob_escape(self._prefix) + b"*"
        for group, node in self._nodes:
            batch: list[bytes] = []
            for name in self._scan(node, match):
                if not is_key_name(name[len(self._prefix) :].decode("latin-1")):
                    self._other += 1
                    continue
                batch.append(name)
                if len(batch) >= _BATCH:
                    yield from self._describe(group, node, batch)
                    batch = []
            if batch:
                yield from self._describe(group, node, batch)

    def _scan(self, node: RedisNode, match: bytes) -> Iterator[bytes]:
        cursor = b"0"
        while True:
            (reply,) = _replies(node, [pack_command(b"SCAN", cursor, b"MATCH", match, b"COUNT", b"1000")], "scan", SCAN)
            if not (isinstance(reply, list) and len(reply) == 2 and isinstance(reply[1], list)):
                raise OSError(f"redis at {node.label}: SCAN got an unusable reply")
            cursor = bytes(reply[0]) if isinstance(reply[0], bytes | bytearray) else b"0"
            for name in reply[1]:
                if isinstance(name, bytes | bytearray) and name.startswith(self._prefix):
                    yield bytes(name)
            if cursor == b"0":
                return

    def _describe(self, group: str, node: RedisNode, names: list[bytes]) -> Iterator[StoreObject]:
        asks = (b"STRLEN", b"OBJECT IDLETIME", b"PTTL")
        commands = [pack_command(*ask.split(), n) for n in names for ask in asks]
        replies = _replies(node, commands, "describe", SMALL)
        now = time.time()
        for i, name in enumerate(names):
            size, idle, ttl = replies[3 * i : 3 * i + 3]
            if type(ttl) is int and ttl >= -1:
                self._ttls.append(ttl)
            label = name[len(self._prefix) :].decode("latin-1")
            if isinstance(size, redis.ResponseError):
                yield StoreObject(label, group, 0, None, ref=(node, name), odd="not a string")
            elif type(size) is int and size > 0:  # 0: deleted since SCAN saw it
                stamp = now - idle if type(idle) is int else None
                yield StoreObject(label, group, size, stamp, ref=(node, name))

    def other_entries(self) -> int:
        """Keys under the prefix seen by the last full listing that are no objects."""
        return self._other

    def read_many(self, objs: Sequence[StoreObject], offset: int, length: int) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(objs)
        by_node: dict[int, tuple[RedisNode, list[int]]] = {}
        for i, obj in enumerate(objs):
            by_node.setdefault(id(obj.ref[0]), (obj.ref[0], []))[1].append(i)
        first, last = str(offset).encode(), str(offset + length - 1).encode()
        for node, index in by_node.values():
            commands = [pack_command(b"GETRANGE", objs[i].ref[1], first, last) for i in index]
            for i, reply in zip(index, _replies(node, commands, "read", Bounds(length)), strict=True):
                if isinstance(reply, bytes | bytearray):
                    out[i] = bytes(reply) if reply or offset else None  # GETRANGE answers an absent key with ""
                else:
                    out[i] = b""  # not a string (any more), or more than asked: no frame
        return out

    def remove(self, obj: StoreObject) -> bool:
        node, name = obj.ref
        (reply,) = _replies(node, [pack_command(b"DEL", name)], "remove", SMALL)
        return reply == 1

    def server_info(self) -> dict[str, Any]:
        """The server's own memory policy (``INFO memory``, per node) and the TTLs its keys really carry (from the
        last listing: kvdi's settings here are the CLI's, not those the engines wrote with)."""
        nodes: dict[str, Any] = {}
        for label, node in self._nodes:
            (reply,) = _replies(node, [pack_command(b"INFO", b"memory")], "info", INFO)
            text = bytes(reply).decode("latin-1") if isinstance(reply, bytes | bytearray) else ""
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            nodes[label] = {
                "maxmemory_policy": fields.get("maxmemory_policy", "unknown").strip(),
                "maxmemory": int(fields.get("maxmemory", "0").strip() or 0),
            }
        lives = [t / 1000 for t in self._ttls if t >= 0]
        ttl = {
            "objects_without_ttl": sum(t == -1 for t in self._ttls),
            "min_s": min(lives) if lives else None,
            "max_s": max(lives) if lives else None,
        }
        return {"nodes": nodes, "ttl": ttl}

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
        else:
            for client in self._clients:
                client.close()


__all__ = ["RedisStoreAdmin"]
