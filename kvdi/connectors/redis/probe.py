"""``check()`` for the Redis stores: reach the server or cluster and say, in one line, what serves.

Both raise :class:`~kvdi.errors.ConfigError` (one line, naming the variable to change) when the
medium cannot serve: unreachable, a cluster node used as one server (``KVDI_REDIS__CLUSTER=0``),
a plain server used as a cluster (``KVDI_REDIS__CLUSTER=1``), or a cluster whose hash slots
are not all covered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdi.connectors.redis.wire import describe
from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from redis.cluster import RedisCluster

HASH_SLOTS = 16384


def _text(reply: object) -> str:
    if isinstance(reply, bytes | bytearray):
        return bytes(reply).decode(errors="replace")
    return reply if isinstance(reply, str) else ""


def check_single(result: list[object] | OSError | None, url: str) -> str:
    """Summary of one reachable, non-cluster server from its ``INFO cluster`` exchange; ConfigError otherwise."""
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
    return f"redis at {url}: reachable, one server (not a cluster)"


def check_cluster(connect: Any, url: str) -> str:
    """Summary of a reachable cluster (masters, replicas, slot coverage); ConfigError otherwise.

    ``connect()`` builds a ``RedisCluster`` (it reads the slot map from a startup node).
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
    finally:
        cluster.close()
    summary = (
        f"redis cluster at {url}: {masters} masters, {replicas} replicas, "
        f"{covered}/{HASH_SLOTS} hash slots covered, cluster_state {state}"
    )
    if covered < HASH_SLOTS or state != "ok":
        raise ConfigError(f"{summary}: the cluster cannot serve every key; fix the cluster (redis-cli --cluster fix)")
    return summary
