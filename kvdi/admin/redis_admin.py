"""Administration of the ``redis`` store on one server or a Redis Cluster (every master, one group each).

Objects are the keys ``key_prefix`` + 32 hex digits, found with ``SCAN MATCH`` (never
``KEYS``: a large store is walked in steps without blocking the server); sizes come from
``STRLEN`` and the last write-or-use time from ``OBJECT IDLETIME``, pipelined per batch. A key
under the prefix with another name is counted as other and never touched; one of another type
(a list, a hash) under an object's name is odd. Reads are bounded by the listed size
(``GETRANGE``). Every call is bounded by the store's own ``connect_timeout_s`` / ``op_timeout_s``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import redis
from redis.cluster import RedisCluster

from kvdi.admin.model import StoreObject, is_key_name
from kvdi.connectors.redis.server import client_options
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


class RedisStoreAdmin:
    """A :class:`~kvdi.admin.model.StoreAdmin` over the server or cluster ``options.url`` names."""

    def __init__(self, options: RedisSettings) -> None:
        raw = options.url.get_secret_value()
        self._prefix = options.key_prefix.encode()
        self.kind = "redis cluster" if options.cluster else "redis"
        self.where = f"{mask_url(raw)} key_prefix={options.key_prefix!r}"
        self._other = 0
        self._cluster: RedisCluster | None = None
        if options.cluster:
            self._cluster = RedisCluster.from_url(raw, require_full_coverage=False, **client_options(options))
            primaries = self._cluster.get_primaries()  # type: ignore[no-untyped-call]
            self._nodes: list[tuple[str, Any]] = [
                (node.name, self._cluster.get_redis_connection(node)) for node in sorted(primaries, key=_name)
            ]
        else:
            client = redis.Redis.from_url(raw, **client_options(options))
            client.ping()  # unreachable: an error now, not an empty store
            self._nodes = [(mask_url(raw), client)]

    def objects(self) -> Iterator[StoreObject]:
        self._other = 0
        match = _glob_escape(self._prefix) + b"*"
        for group, client in self._nodes:
            batch: list[bytes] = []
            for name in client.scan_iter(match=match, count=1000):
                if not is_key_name(name[len(self._prefix) :].decode("latin-1")):
                    self._other += 1
                    continue
                batch.append(name)
                if len(batch) >= _BATCH:
                    yield from self._describe(group, client, batch)
                    batch = []
            if batch:
                yield from self._describe(group, client, batch)

    def _describe(self, group: str, client: Any, names: list[bytes]) -> Iterator[StoreObject]:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
            pipe.object("idletime", name)
        replies = pipe.execute(raise_on_error=False)
        now = time.time()
        for i, name in enumerate(names):
            size, idle = replies[2 * i], replies[2 * i + 1]
            label = name[len(self._prefix) :].decode("latin-1")
            if isinstance(size, redis.ResponseError):
                yield StoreObject(label, group, 0, None, ref=(client, name), odd="not a string")
            elif isinstance(size, int) and size > 0:  # 0: deleted since SCAN saw it
                stamp = now - idle if isinstance(idle, int) else None
                yield StoreObject(label, group, size, stamp, ref=(client, name))

    def other_entries(self) -> int:
        """Keys under the prefix seen by the last full listing that are no objects."""
        return self._other

    def read(self, obj: StoreObject) -> bytes | None:
        client, name = obj.ref
        data = client.getrange(name, 0, obj.size)  # one byte more than listed: a grown value shows as bad length
        if not data and not client.exists(name):
            return None
        return bytes(data)

    def remove(self, obj: StoreObject) -> bool:
        client, name = obj.ref
        return bool(client.delete(name))

    def close(self) -> None:
        if self._cluster is not None:
            self._cluster.close()
        else:
            for _, client in self._nodes:
                client.close()


__all__ = ["RedisStoreAdmin"]
