"""The ``redis`` connector on a real Redis Cluster on loopback: sharding, a dead master, failover, ``check()``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers.redis import require_redis_tools

redis = pytest.importorskip("redis")
torch = pytest.importorskip("torch")

from kvdi.connectors.redis import BreakerState, RedisBlockStore, RedisClusterBlockStore, open_store  # noqa: E402
from kvdi.connectors.redis.wire import BAD_OBJECT  # noqa: E402
from kvdi.connectors.store.framing import frame_header  # noqa: E402
from kvdi.connectors.store.keys import block_keys  # noqa: E402
from kvdi.containers import EngineContainer  # noqa: E402
from kvdi.errors import ConfigError  # noqa: E402
from kvdi.layout import KVCacheSpec  # noqa: E402
from kvdi.settings import RedisSettings, load_settings  # noqa: E402
from kvdi.testing.redis_server import (  # noqa: E402
    RedisClusterServers,
    RedisServer,
    command,
)

pytestmark = pytest.mark.redis

FINGERPRINT = bytes(range(16))
KEYS = [bytes([i]) * 16 for i in range(1, 31)]  # 30 keys: every master of 3 holds some
PROMPTS = [[(i * 37) % 1000 + 1 for i in range(16 * 6 + 3)], [(i * 11) % 1000 + 1 for i in range(16 * 3 + 1)]]
FAST = {"connect_timeout_s": 0.5, "op_timeout_s": 0.5, "breaker_failures": 1, "breaker_reset_s": 0.2}


def framed(i: int) -> list[bytes]:
    payload = bytes([i % 251]) * 512
    return [frame_header(FINGERPRINT, payload, name=KEYS[i % len(KEYS)]), payload]


def _cluster(masters: int = 3, replicas: int = 0) -> RedisClusterServers:
    require_redis_tools()
    return RedisClusterServers(masters=masters, replicas=replicas).start()


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[RedisClusterServers]:
    """One 3-master cluster for the tests that kill nothing (each uses its own key prefix)."""
    cluster = _cluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster() -> Iterator[RedisClusterServers]:
    """A fresh 3-master cluster, for tests that kill a node."""
    made = _cluster()
    yield made
    made.stop()


@pytest.fixture
def make_store(request: pytest.FixtureRequest) -> Iterator[Callable[..., RedisClusterBlockStore]]:
    """``make_store(cluster, **options)``: a cluster store with fast failure settings and this test's key prefix."""
    stores: list[RedisClusterBlockStore] = []

    def make(on: RedisClusterServers, **options: Any) -> RedisClusterBlockStore:
        fields = {"url": on.url, "cluster": True, "key_prefix": f"{request.node.name}:", **FAST, **options}
        store = RedisClusterBlockStore(RedisSettings.model_validate(fields))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def keys_on(node: RedisServer, prefix: str) -> int:
    """How many keys starting with ``prefix`` ``node`` holds."""
    reply = command(node.port, "KEYS", prefix + "*")
    assert isinstance(reply, list)
    return len(reply)


def by_master(on: RedisClusterServers, store: RedisClusterBlockStore, keys: list[bytes]) -> dict[int, list[int]]:
    """Positions of ``keys`` grouped by the port of the master holding them (asked of the cluster itself)."""
    shards = command(on.running()[0].port, "CLUSTER", "SLOTS")
    assert isinstance(shards, list)
    groups: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        slot = command(on.running()[0].port, "CLUSTER", "KEYSLOT", store.key_prefix + key.hex())
        assert isinstance(slot, int)
        port = next(int(s[2][1]) for s in shards if int(s[0]) <= slot <= int(s[1]))
        groups.setdefault(port, []).append(i)
    return groups


# The store on a healthy cluster


def test_objects_round_trip_and_spread_over_every_master(
    shared_cluster: RedisClusterServers, make_store: Callable[..., RedisClusterBlockStore]
) -> None:
    store = make_store(shared_cluster)
    assert store.put_many([(k, framed(i)) for i, k in enumerate(KEYS)]) == len(KEYS)
    assert store.get_many(KEYS[:3]) == [b"".join(framed(i)) for i in range(3)]
    assert all(keys_on(m, store.key_prefix) for m in shared_cluster.masters())


def test_a_compressing_cluster_store_round_trips_and_reports_its_writes_to_auto(
    shared_cluster: RedisClusterServers, make_store: Callable[..., RedisClusterBlockStore]
) -> None:
    pytest.importorskip("zstandard")
    from kvdi.connectors.store.codec import compressor_for, unframe_into

    store = make_store(shared_cluster)
    store.compressor = compressor = compressor_for("auto", None, "KVDI_REDIS__COMPRESSION")
    assert compressor is not None and compressor.rule is not None
    assert store.put_many([(k, framed(i)) for i, k in enumerate(KEYS)]) == len(KEYS)
    assert compressor.compressed_blocks == len(KEYS) and compressor.rule.link_bps is not None
    out = bytearray(512)
    for i, obj in enumerate(store.get_many(KEYS)):
        assert obj is not None and len(obj) < 512
        unframe_into(obj, [memoryview(out)], FINGERPRINT, 512, name=KEYS[i])
        assert bytes(out) == framed(i)[1]


def test_count_prefix_stops_at_the_first_gap(
    shared_cluster: RedisClusterServers, make_store: Callable[..., RedisClusterBlockStore]
) -> None:
    store = make_store(shared_cluster)
    store.put_many([(k, framed(i)) for i, k in enumerate(KEYS) if i != 7])
    assert store.count_prefix(KEYS) == 7
    assert [v is None for v in store.get_many(KEYS[6:9])] == [False, True, False]


def test_a_key_of_the_wrong_type_reads_as_a_bad_object_not_an_exception(
    shared_cluster: RedisClusterServers, make_store: Callable[..., RedisClusterBlockStore]
) -> None:
    store = make_store(shared_cluster)
    client = redis.cluster.RedisCluster.from_url(shared_cluster.url)
    client.rpush(store.key_prefix + KEYS[0].hex(), b"not a frame")
    client.close()
    assert store.count_prefix(KEYS[:1]) == 1  # present: the load will drop it
    assert store.get_many(KEYS[:1]) == [BAD_OBJECT]
    store.discard(KEYS[0])
    assert store.count_prefix(KEYS[:1]) == 0


def test_check_reports_masters_and_full_slot_coverage(
    shared_cluster: RedisClusterServers, make_store: Callable[..., RedisClusterBlockStore]
) -> None:
    summary = make_store(shared_cluster).check()
    assert "3 masters" in summary and "16384/16384 hash slots covered" in summary and "\n" not in summary


def test_check_with_cluster_on_a_plain_server_is_one_line_saying_which(redis_server: RedisServer) -> None:
    store = RedisClusterBlockStore(RedisSettings(url=redis_server.url, cluster=True))
    with pytest.raises(ConfigError, match="KVDI_REDIS__CLUSTER=1 but .* is a plain Redis server") as info:
        store.check()
    assert "\n" not in str(info.value)


def test_check_without_cluster_on_a_cluster_node_is_one_line_saying_which(
    shared_cluster: RedisClusterServers,
) -> None:
    store = RedisBlockStore(RedisSettings(url=shared_cluster.url))
    with pytest.raises(ConfigError, match="KVDI_REDIS__CLUSTER is off but .* is a Redis Cluster node") as info:
        store.check()
    assert "\n" not in str(info.value)
    store.close()


def test_open_store_picks_the_cluster_store_from_settings(shared_cluster: RedisClusterServers) -> None:
    settings = load_settings(kv_connector="redis", redis={"url": shared_cluster.url, "cluster": True})
    store = open_store(settings.redis, KVCacheSpec.from_settings(settings), settings)
    assert isinstance(store, RedisClusterBlockStore)
    store.close()


# A dead master, failover


def test_a_dead_master_is_a_miss_for_its_keys_only(
    cluster: RedisClusterServers, make_store: Callable[..., RedisClusterBlockStore]
) -> None:
    store = make_store(cluster)
    store.put_many([(k, framed(i)) for i, k in enumerate(KEYS)])
    groups = by_master(cluster, store, KEYS)
    victim = next(n for n in cluster.nodes if n.port in groups)
    lost = set(groups[victim.port])
    victim.kill()

    values = store.get_many(KEYS)
    again = store.get_many(KEYS)  # its breaker is open now: no call to it at all

    for got in (values, again):
        assert [i for i, v in enumerate(got) if v is None] == sorted(lost)
    assert store.missed_keys >= 2 * len(lost)
    states = {name: b.state for name, b in store.breakers.items()}
    assert states[f"127.0.0.1:{victim.port}"] is not BreakerState.CLOSED
    assert sum(s is BreakerState.CLOSED for s in states.values()) == 2
    # Contract 2: a batch spanning the dead node counts only what the live nodes stored.
    assert store.put_many([(k, framed(i)) for i, k in enumerate(KEYS)]) == len(KEYS) - len(lost)


def test_after_failover_hits_resume_without_a_new_store(make_store: Callable[..., RedisClusterBlockStore]) -> None:
    replicated = _cluster(masters=3, replicas=1)
    try:
        store = make_store(replicated)
        store.put_many([(k, framed(i)) for i, k in enumerate(KEYS)])
        _wait_replicated(replicated)
        from_replicas = make_store(replicated, read_from_replicas=True)  # READONLY connections, round robin
        for _ in range(2):  # twice: each slot's master, then its replica
            assert from_replicas.get_many(KEYS) == [b"".join(framed(i)) for i in range(len(KEYS))]
        assert len(from_replicas.breakers) == 6  # every node served some reads
        groups = by_master(replicated, store, KEYS)
        victim = next(n for n in replicated.nodes if n.port in groups)
        victim.kill()
        assert store.count_prefix(KEYS) < len(KEYS) or store.get_many(KEYS).count(None) > 0

        replicated.wait_ok()  # a replica was promoted
        for _ in range(100):  # bounded: the slot map is read again at most every breaker_reset_s
            if store.count_prefix(KEYS) == len(KEYS):
                break
            time.sleep(0.05)
        assert store.count_prefix(KEYS) == len(KEYS)
        assert store.get_many(KEYS) == [b"".join(framed(i)) for i in range(len(KEYS))]
    finally:
        replicated.stop()


def test_a_hung_master_is_a_miss_for_its_keys_and_serves_again_when_it_wakes(
    cluster: RedisClusterServers, make_store: Callable[..., RedisClusterBlockStore]
) -> None:
    store = make_store(cluster)
    store.put_many([(k, framed(i)) for i, k in enumerate(KEYS)])
    groups = by_master(cluster, store, KEYS)
    victim = next(n for n in cluster.nodes if n.port in groups)
    victim.freeze()  # SIGSTOP: it keeps its sockets and answers nothing
    try:
        hung = store.get_many(KEYS)  # its share times out after op_timeout_s; the others load
    finally:
        victim.thaw()
    assert [i for i, v in enumerate(hung) if v is None] == groups[victim.port]
    for _ in range(100):  # bounded: its breaker lets a probe through after breaker_reset_s
        if None not in store.get_many(KEYS):
            break
        time.sleep(0.05)
    assert store.get_many(KEYS) == [b"".join(framed(i)) for i in range(len(KEYS))]


def _wait_replicated(on: RedisClusterServers) -> None:
    """Wait until every replica holds as many keys as its master, and clients are told about the replicas."""
    deadline = time.monotonic() + 20
    synced = listed = False
    while time.monotonic() < deadline and not (synced and listed):
        pairs = []
        for node in on.running():
            role = command(node.port, "ROLE")
            if isinstance(role, list) and role[0] == b"slave":
                pairs.append((on.dbsize(node), command(int(role[2]), "DBSIZE")))
        synced = bool(pairs) and all(mine == theirs for mine, theirs in pairs)
        shards = command(on.nodes[0].port, "CLUSTER", "SLOTS")  # omits replicas still syncing
        listed = isinstance(shards, list) and all(len(shard) > 3 for shard in shards)
        time.sleep(0.05)
    assert synced and listed, f"replicas in sync: {synced}, listed in CLUSTER SLOTS: {listed}"


# The reference engine and the CLI on a cluster


@pytest.fixture
def engines(engine_containers: Callable[..., EngineContainer]) -> Callable[..., EngineContainer]:
    def make(url: str, **extra: Any) -> EngineContainer:
        redis_options = {"url": url, "cluster": True, **FAST, "breaker_failures": 2}
        return engine_containers(allocator={"device": "cpu", "num_blocks": 32}, redis=redis_options, **extra)

    return make


def tokens(outputs: list[Any]) -> list[tuple[int, ...]]:
    assert all(o.ok for o in outputs), [o.error for o in outputs]
    return [o.output_token_ids for o in outputs]


def test_engine_with_a_master_killed_between_producer_and_consumer_recomputes_what_it_held(
    cluster: RedisClusterServers, engines: Callable[..., EngineContainer]
) -> None:
    expected = tokens(engines(cluster.url, kv_connector="null").engine().generate(PROMPTS, 6))
    engines(cluster.url, kv_connector="redis", kv_role="kv_producer").engine().generate(PROMPTS, 6)
    cluster.masters()[1].kill()
    consumer = engines(cluster.url, kv_connector="redis", kv_role="kv_consumer")

    outputs = consumer.engine().generate(PROMPTS, 6)

    assert tokens(outputs) == expected
    full = [16 * 6, 16 * 3]
    assert [o.num_loaded_tokens for o in outputs] != full  # what the dead node held is recomputed
    store = consumer.kv.backend()
    assert store.missed_keys > 0
    assert consumer.engine().connector_stats().total.lookup_hit_blocks < 9


def test_engine_hits_come_back_after_failover_without_a_restart(engines: Callable[..., EngineContainer]) -> None:
    replicated = _cluster(masters=3, replicas=1)
    try:
        expected = tokens(engines(replicated.url, kv_connector="null").engine().generate(PROMPTS, 6))
        engines(replicated.url, kv_connector="redis", kv_role="kv_producer").engine().generate(PROMPTS, 6)
        _wait_replicated(replicated)
        consumer = engines(replicated.url, kv_connector="redis", kv_role="kv_consumer").engine()
        next(m for m in replicated.masters() if m is not replicated.nodes[0]).kill()  # not the URL's node
        during = consumer.generate(PROMPTS, 6)
        replicated.wait_ok()
        for _ in range(100):  # bounded: breakers probe and the slot map is read again every 0.2 s
            time.sleep(0.05)
            after = consumer.generate(PROMPTS, 6)
            if [o.num_loaded_tokens for o in after] == [16 * 6, 16 * 3]:
                break
        assert tokens(during) == tokens(after) == expected
        assert [o.num_loaded_tokens for o in after] == [16 * 6, 16 * 3]
    finally:
        replicated.stop()


def test_kvdi_demo_on_a_cluster_is_identical_and_stores_keys_on_every_master(
    shared_cluster: RedisClusterServers,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDI_")}
    env.update(KVDI_KV_CONNECTOR="redis", KVDI_REDIS__CLUSTER="1", KVDI_REDIS__URL=shared_cluster.url)
    env.update(KVDI_REDIS__KEY_PREFIX="demo:", PYTHONPATH=os.getcwd())
    done = subprocess.run(
        [sys.executable, "-m", "kvdi.cli", "demo", "--json", "--keep", "--prompts", "3", "--prompt-len", "96"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["identical"] and report["loaded_tokens"] > 0
    assert "Traceback" not in done.stderr
    assert all(keys_on(m, "demo:") for m in shared_cluster.masters())


def test_cluster_key_names_are_the_single_server_names(shared_cluster: RedisClusterServers) -> None:
    """No hash tag: the same key prefix + hex names as on one server, spread by slot."""
    layout = KVCacheSpec.from_settings(load_settings())
    keys = block_keys(PROMPTS[0], layout)
    names = [("kvdi:" + k.hex()).encode() for k in keys]
    assert all(b"{" not in n for n in names)
    slots = {command(shared_cluster.nodes[0].port, "CLUSTER", "KEYSLOT", n.decode()) for n in names}
    assert len(slots) == len(names)
