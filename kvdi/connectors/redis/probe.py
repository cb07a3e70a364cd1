"""``check()`` for the Redis stores: reach the server or cluster and say, in one line, what serves.

Both raise :class:`~kvdi.errors.ConfigError` (one line, naming the variable to change) when the
medium cannot serve: unreachable, a cluster node used as one server (``KVDI_REDIS__CLUSTER=0``),
a plain server used as a cluster (``KVDI_REDIS__CLUSTER=1``), a cluster whose hash slots are
not all covered, or a server (every master of a cluster) that does not store an object: each
check writes a small probe key (``<key_prefix>kvdi-check-<random>``, ``EX 60``) and deletes it,
so a read-only replica, a full server under ``noeviction`` or a user without write rights fails
``kvdi check`` instead of failing every save later. A probe is tiny, so each check also reads
``INFO memory``: a ``maxmemory`` smaller than one frame, or one with ``maxmemory_policy
noeviction`` and room for fewer than :data:`MIN_ROOM_FRAMES` frames, is refused (Redis would
soon answer every save ``OOM``);
``noeviction`` with room to spare passes with a warning in the summary (the store fills, then
every save fails: an eviction policy such as ``allkeys-lru`` keeps it serving).

Every exchange here, on a cluster's masters too, goes through the bounded reader with the
store's deadline (:mod:`.bounded`); only redis-py's own slot-map read at connect does not.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvdi.connectors.redis.bounded import INFO, Bounds
from kvdi.connectors.redis.wire import describe, written
from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from redis.cluster import RedisCluster

HASH_SLOTS = 16384
PROBE_TTL_S = 60
MIN_ROOM_FRAMES = 256
"""Under ``noeviction``, a server with room for fewer frames than this is refused: it is full within a few prompts."""


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


def memory_warning(info: str, frame_bytes: int | None, url: str, where: str) -> str:
    """From an ``INFO memory`` reply: ConfigError when the memory policy refuses a frame; a warning (or "")."""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)

    def number(name: str) -> int:
        value = fields.get(name, "0").strip()
        return int(value) if value.isdigit() else 0

    limit, used, policy = number("maxmemory"), number("used_memory"), fields.get("maxmemory_policy", "").strip()
    if limit <= 0:
        return ""
    frame = frame_bytes or 0
    if limit < frame:
        raise _refused(url, where, f"maxmemory {limit} B is smaller than one frame of {frame} B")
    if policy == "noeviction":
        if limit - used < MIN_ROOM_FRAMES * frame:
            why = f"maxmemory {limit} B, {max(limit - used, 0)} B free under maxmemory_policy noeviction"
            raise _refused(url, where, f"{why}: room for fewer than {MIN_ROOM_FRAMES} frames of {frame} B")
        return (
            f"; warning: {where} has maxmemory_policy noeviction (maxmemory {limit} B): once full, every save "
            "fails; set an eviction policy such as allkeys-lru"
        )
    return ""


def check_single(
    result: list[object] | OSError | None, url: str, probe: Any = None, frame_bytes: int | None = None
) -> str:
    """Summary of one reachable, non-cluster server from its ``INFO cluster`` (and ``INFO memory``) exchange;
    ConfigError otherwise.

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
        warning = memory_warning(_text(result[1]), frame_bytes, url, "the server") if len(result) > 1 else ""
        return f"redis at {url}: reachable, one server (not a cluster), a probe write and delete succeeded{warning}"
    return f"redis at {url}: reachable, one server (not a cluster)"


def _reply_text(reply: object) -> str:
    if isinstance(reply, BaseException):
        return f"{type(reply).__name__}: {describe(reply)[:200]}"
    return f"unexpected reply {_text(reply)[:60]!r}" if _text(reply) else f"a reply of type {type(reply).__name__}"


Run = Callable[[Any, Any, Sequence[tuple[bytes, ...]], Bounds], "list[object] | OSError"]
"""``run(cluster, node, commands, bounds)``: one bounded exchange with a cluster node (its replies or the failure)."""


def probe_masters(cluster: RedisCluster, prefix: bytes, url: str, run: Run, frame_bytes: int | None = None) -> str:
    """Write and delete a probe key on every master (a key of one of its slots) and read its memory policy;
    the warnings (or "")."""
    from redis.crc import key_slot

    manager = cluster.nodes_manager
    masters = {n.name for n in manager.get_nodes_by_server_type("primary")}
    owner = {slot: nodes[0] for slot, nodes in manager.slots_cache.items() if nodes}
    probed: set[str] = set()
    warnings = ""
    base = probe_name(prefix)
    for i in range(64 * HASH_SLOTS):  # enough tries to land in every master's slots
        if probed >= masters:
            break
        name = base + b"-%d" % i
        node = owner.get(key_slot(name))
        if node is None or node.name in probed:
            continue
        where = f"master {node.name}"
        ttl = str(PROBE_TTL_S).encode()
        replies = run(cluster, node, [(b"SET", name, b"probe", b"EX", ttl), (b"DEL", name), (b"INFO", b"memory")], INFO)
        if isinstance(replies, OSError):
            raise _refused(url, where, describe(replies)[:200])
        if not written(replies[0]):
            raise _refused(url, where, _reply_text(replies[0]))
        warnings += memory_warning(_text(replies[2]), frame_bytes, url, where)
        probed.add(node.name)
    return warnings


def _cluster_state(cluster: RedisCluster, run: Run) -> str:
    """``cluster_state`` from ``CLUSTER INFO`` on one master ("?" when it says nothing readable)."""
    masters = cluster.nodes_manager.get_nodes_by_server_type("primary")
    if not masters:
        return "?"
    replies = run(cluster, masters[0], [(b"CLUSTER", b"INFO")], INFO)
    if isinstance(replies, OSError):
        raise replies
    fields = dict(line.split(":", 1) for line in _text(replies[0]).splitlines() if ":" in line)
    return fields.get("cluster_state", "?").strip() or "?"


def check_cluster(
    connect: Any, url: str, prefix: bytes | None = None, run: Run | None = None, frame_bytes: int | None = None
) -> str:
    """Summary of a reachable cluster (masters, replicas, slot coverage); ConfigError otherwise.

    ``connect()`` builds a ``RedisCluster`` (it reads the slot map from a startup node). With
    ``prefix`` (the store's key prefix) and ``run``, every master must store and delete a probe key
    and have room for a frame of ``frame_bytes`` under its memory policy.
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
        warnings = ""
        if run is None:
            info = cluster.cluster_info()
            state = str(info.get("cluster_state", "?")) if isinstance(info, dict) else "?"
        else:
            try:
                state = _cluster_state(cluster, run)
            except Exception as exc:
                raise ConfigError(f"KVDI_REDIS__URL={url}: CLUSTER INFO failed ({describe(exc)})") from None
        if prefix is not None and run is not None and covered == HASH_SLOTS and state == "ok":
            warnings = probe_masters(cluster, prefix, url, run, frame_bytes)
    finally:
        cluster.close()
    summary = (
        f"redis cluster at {url}: {masters} masters, {replicas} replicas, "
        f"{covered}/{HASH_SLOTS} hash slots covered, cluster_state {state}"
    )
    if covered < HASH_SLOTS or state != "ok":
        raise ConfigError(f"{summary}: the cluster cannot serve every key; fix the cluster (redis-cli --cluster fix)")
    return summary + warnings
