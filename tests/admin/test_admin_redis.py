"""``kvdi store stats|verify|clear`` on a real redis-server and a real 3-master Redis Cluster."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.helpers.redis import require_redis_tools

redis = pytest.importorskip("redis")

from kvdi.admin import clear_store, open_admin, store_stats, verify_store  # noqa: E402
from kvdi.connectors.redis import RedisBlockStore, RedisClusterBlockStore  # noqa: E402
from kvdi.settings import RedisSettings, load_settings  # noqa: E402
from kvdi.testing.redis_server import RedisClusterServers, RedisServer  # noqa: E402
from tests.admin.helpers import corruptions, frame, key, kvdi  # noqa: E402

pytestmark = pytest.mark.redis

GOOD = 60
PREFIX = "fleet:"


def _plant(client: redis.Redis) -> dict[str, str]:
    """Corrupt objects, a hash under an object's name and a foreign key; the expected reasons by name (the object
    without the frame magic and the hash are foreign: never counted, never dropped)."""
    expected = {}
    for i, (reason, obj) in enumerate(corruptions().items()):
        client.set(f"{PREFIX}{key(1000 + i).hex()}", obj)
        if reason != "magic":
            expected[key(1000 + i).hex()] = reason
    client.hset(f"{PREFIX}{key(2000).hex()}", "x", "y")
    client.set(f"{PREFIX}not-a-block", b"someone else's")
    client.set(f"other:{key(1).hex()}", frame(1))  # another prefix: another store
    return expected


def _fill(options: RedisSettings) -> None:
    store = RedisClusterBlockStore(options) if options.cluster else RedisBlockStore(options)
    try:
        assert store.put_many([(key(i), [frame(i)]) for i in range(GOOD)]) == GOOD
    finally:
        store.close()


def _exercise(url: str, cluster: bool, plant_client: redis.Redis | redis.RedisCluster, nodes: int) -> None:
    options = RedisSettings(url=url, cluster=cluster, key_prefix=PREFIX)  # type: ignore[arg-type]
    _fill(options)
    expected = _plant(plant_client)  # type: ignore[arg-type]
    settings = load_settings(kv_connector="redis", redis=options.model_dump() | {"url": url})
    admin = open_admin(settings)
    try:
        stats = store_stats(admin)
        sizes = [len(frame(i)) for i in range(GOOD)] + [len(v) for r, v in corruptions().items() if r != "magic"]
        assert (stats.total.objects, stats.total.bytes) == (len(sizes), sum(sizes))
        assert len(stats.groups) == 2 and all(g.objects for g in stats.groups.values())  # two layouts
        assert len(stats.nodes) == (nodes if cluster else 0) and all(g.objects for g in stats.nodes.values())
        assert stats.other == 1 and stats.odd == 1 and stats.foreign == 2
        report = verify_store(admin, drop=True)
        assert {b.name: b.reason for b in report.bad} == expected
        assert report.good == GOOD and all(b.dropped for b in report.bad)
        assert {f.name: f.why for f in report.foreign} == {
            key(1001).hex(): "no frame header",
            key(2000).hex(): "not a string",
        }
        assert verify_store(admin).bad == []
        assert len(clear_store(admin).removed) == GOOD
        assert store_stats(admin).total.objects == 0
    finally:
        admin.close()
    assert plant_client.get(f"{PREFIX}not-a-block") == b"someone else's"
    assert plant_client.exists(f"{PREFIX}{key(1001).hex()}", f"{PREFIX}{key(2000).hex()}") == 2  # foreign: kept
    assert plant_client.get(f"other:{key(1).hex()}") == frame(1)


def test_single_server_stats_verify_clear(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    try:
        _exercise(redis_server.url, False, client, nodes=1)
    finally:
        client.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    require_redis_tools()
    made = RedisClusterServers(masters=3, replicas=0).start()
    yield made
    made.stop()


def test_cluster_stats_per_master_verify_clear(cluster: RedisClusterServers) -> None:
    """Every master is one group; the planted objects are found on whichever master holds them."""
    client = redis.RedisCluster.from_url(cluster.url)
    try:
        _exercise(cluster.url, True, client, nodes=3)
    finally:
        client.close()


def test_cli_on_cluster_and_unreachable_server(cluster: RedisClusterServers) -> None:
    """The CLI on the cluster (stats --json per node, verify exit 0, clear --yes); a dead URL is one line, exit 2,
    its password masked."""
    env = {"KVDI_KV_CONNECTOR": "redis", "KVDI_REDIS__URL": cluster.url, "KVDI_REDIS__CLUSTER": "1",
           "KVDI_REDIS__KEY_PREFIX": "cli:"}  # fmt: skip
    _fill(RedisSettings(url=cluster.url, cluster=True, key_prefix="cli:"))  # type: ignore[arg-type]
    stats = kvdi("store", "stats", "--json", env=env)
    assert stats.returncode == 0, stats.stderr
    info = json.loads(stats.stdout)
    assert info["objects"] == GOOD and len(info["nodes"]) == 3 and info["kind"] == "redis cluster"
    assert info["settings"]["redis"]["cluster"] is True
    assert kvdi("store", "verify", env=env).returncode == 0
    cleared = kvdi("store", "clear", "--yes", "--json", env=env)
    assert cleared.returncode == 0 and json.loads(cleared.stdout)["removed"] == GOOD
    dead = kvdi(
        "store", "stats", env={"KVDI_KV_CONNECTOR": "redis", "KVDI_REDIS__URL": "redis://:s3cret@127.0.0.1:1/0"}
    )
    assert dead.returncode == 2 and dead.stderr.count("\n") == 1
    assert "s3cret" not in dead.stderr and "Traceback" not in dead.stderr


def test_cluster_canonical_sections_per_node_verified_and_cleared_by_model(cluster: RedisClusterServers) -> None:
    """Canonical sections spread over the masters: counted per format and node, verified good (one flipped bit
    bad), cleared by ``canonical:<fingerprint>`` beside per-rank frames that stay."""
    from kvdi.admin import Selection, parse_layout
    from tests.admin.helpers import BLOCKS_A, FP_A, A, write_sections

    options = RedisSettings(url=cluster.url, cluster=True, key_prefix="canon:")
    store = RedisClusterBlockStore(options)
    try:
        write_sections(store, A, BLOCKS_A)  # 16 sections
        assert store.put_many([(key(i), [frame(i)]) for i in range(4)]) == 4
    finally:
        store.close()
    client = redis.RedisCluster.from_url(cluster.url)
    name = f"canon:{A.sections()[0].key(BLOCKS_A[0]).hex()}"
    data = bytearray(client.get(name))
    data[-1] ^= 1
    client.set(name, bytes(data))
    settings = load_settings(kv_connector="redis", redis=options.model_dump() | {"url": cluster.url})
    admin = open_admin(settings)
    try:
        stats = store_stats(admin)
        assert {n: g.objects for n, g in stats.formats.items()} == {"canonical": 16, "per_rank": 4}
        assert sum(g.objects for g in stats.nodes.values()) == 20 and len(stats.nodes) == 3
        report = verify_store(admin)
        assert [(b.reason, b.format) for b in report.bad] == [("checksum", "canonical")] and report.good == 19
        removed = clear_store(admin, selection=Selection(parse_layout(f"canonical:{FP_A}")))
        assert removed.formats == {"canonical": 16}
        assert {n: g.objects for n, g in store_stats(admin).formats.items()} == {"per_rank": 4}
    finally:
        admin.close()
        client.close()
