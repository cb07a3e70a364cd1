"""``check()`` for the Redis stores: reach the server or cluster and say, in one line, what serves.

Both raise :class:`~kvdi.errors.ConfigError` (one line, naming the variable to change) when the
medium cannot serve: unreachable, a cluster node used as one server (``KVDI_REDIS__CLUSTER=0``),
a plain server used as a cluster (``KVDI_REDIS__CLUSTER=1``), a cluster whose hash slots are
not all covered, or a server (every master of a cluster) that does not store an object: each
check writes a small probe key (``<key_prefix>kvdi-check-<random>``, ``EX 60``) and deletes it,
so a read-only replica, a full server under ``noeviction`` or a user without write rights fails
``kvdi check`` instead of failing every save later.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from kvdi.connectors.redis.wire import describe, written
from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from redis.cluster import RedisCluster

HASH_SLOTS = 16384
PROBE_TTL_S = 60


def probe_name(prefix: bytes) -> bytes:
    """A fresh key name for one probe write (never a block key: block keys are hex only)."""
    return prefix + b"kvdi-check-" + secrets.token_hex(8).encode()


def _refused(url: str, where: str, why: str) -> ConfigError:
    return ConfigError(
        f"KVDI_REDIS__URL={url}: {where} does not store objects ({why}); every save would fail: point it at a "
        "writable primary with free memory (or an eviction policy such as allkeys-lru) and write rights"
    )


def _text(reply: object) -> str:
    if isinstance(reply, bytes | bytearray):
        return bytes(reply).decode(errors="replace")
    return reply if isinstance(reply, str) else ""


def check_single(result: list[object] | OSError | None, url: str, probe: Any = None) -> str:
    """Summary of one reachable, non-cluster server from its ``INFO cluster`` exchange; ConfigError otherwise.

    ``probe()`` (when given) writes and deletes a probe key, returning the SET and DEL replies (or an OSError).
    """
    if isinstance(result, OSError):
        raise ConfigError(f"KVDI_REDIS__URL={url}: redis server cannot serve: {result}")
    assert result is not None
    info = _text(result[0])
    if "cluster_enabled:1" in info:
        raise ConfigError(
            f"KVDI_REDIS__CLUSTER is off but KVDI_REDIS__URL={url} is a Redis Cluster node; "
            "set KVDI_REDIS__CLUSTER=1 (with it off, keys of other nodes' slots would all miss)"
        )
    if "cluster_enabled:" not in info:
        raise ConfigError(f"KVDI_REDIS__URL={url}: the server's INFO reply is not Redis's ({info[:40]!r})")
    if probe is not None:
        replies = probe()
        if isinstance(replies, OSError):
            raise _refused(url, "the server", describe(replies))
        if not written(replies[0]):
            raise _refused(url, "the server", _reply_text(replies[0]))
        return f"redis at {url}: reachable, one server (not a cluster), a probe write and delete succeeded"
    return f"redis at {url}: reachable, one server (not a cluster)"


def _reply_text(reply: object) -> str:
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {describe(reply)[:200]}"
    return f"unexpected reply {_text(reply)[:60]!r}" if _text(reply) else f"a reply of type {type(reply).__name__}"


def probe_masters(cluster: RedisCluster, prefix: bytes, url: str) -> int:
    """Write and delete a probe key on every master (a key of one of its slots); the number probed."""
    from redis.crc import key_slot

    manager = cluster.nodes_manager
    masters = {n.name for n in manager.get_nodes_by_server_type("primary")}
    owner = {slot: nodes[0].name for slot, nodes in manager.slots_cache.items() if nodes}
    probed: set[str] = set()
    base = probe_name(prefix)
    for i in range(64 * HASH_SLOTS):  # enough tries to land in every master's slots
        if probed >= masters:
            break
        name = base + b"-%d" % i
        node = owner.get(key_slot(name))
        if node is None or node in probed:
            continue
        try:
            stored = cluster.set(name, b"probe", ex=PROBE_TTL_S)
            cluster.delete(name)
        except Exception as exc:
            raise _refused(url, f"master {node}", describe(exc)[:200]) from None
        if not stored:
            raise _refused(url, f"master {node}", "SET was not acknowledged")
        probed.add(node)
    return len(probed)


def check_cluster(connect: Any, url: str, prefix: bytes | None = None) -> str:
    """Summary of a reachable cluster (masters, replicas, slot coverage); ConfigError otherwise.

    ``connect()`` builds a ``RedisCluster`` (it reads the slot map from a startup node). With
    ``prefix`` (the store's key prefix), every master must store and delete a probe key.
    """
    from redis.exceptions import RedisClusterException

    try:
        cluster: RedisCluster = connect()
    except RedisClusterException as exc:
        if "cluster mode is not enabled" in str(exc).lower():
            raise ConfigError(
                f"KVDI_REDIS__CLUSTER=1 but KVDI_REDIS__URL={url} is a plain Redis server (cluster mode "
                "disabled); set KVDI_REDIS__CLUSTER=0, or name a node of a Redis Cluster"
            ) from None
        raise ConfigError(f"KVDI_REDIS__URL={url}: Redis Cluster unreachable ({describe(exc)})") from None
    except Exception as exc:
        raise ConfigError(f"KVDI_REDIS__URL={url}: Redis Cluster unreachable ({describe(exc)})") from None
    try:
        manager = cluster.nodes_manager
        masters = len(manager.get_nodes_by_server_type("primary"))
        replicas = len(manager.get_nodes_by_server_type("replica"))
        covered = sum(1 for nodes in manager.slots_cache.values() if nodes)
        try:
            info = cluster.cluster_info()
            state = str(info.get("cluster_state", "?")) if isinstance(info, dict) else "?"
        except Exception as exc:
            raise ConfigError(f"KVDI_REDIS__URL={url}: CLUSTER INFO failed ({describe(exc)})") from None
        if prefix is not None and covered == HASH_SLOTS and state == "ok":
            probe_masters(cluster, prefix, url)
    finally:
        cluster.close()
    summary = (
        f"redis cluster at {url}: {masters} masters, {replicas} replicas, "
        f"{covered}/{HASH_SLOTS} hash slots covered, cluster_state {state}"
    )
    if covered < HASH_SLOTS or state != "ok":
        raise ConfigError(f"{summary}: the cluster cannot serve every key; fix the cluster (redis-cli --cluster fix)")
    return summary
