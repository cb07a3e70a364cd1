"""``get_range_into_many`` of the Redis, Redis Cluster and S3 stores (real servers on loopback): the contract,
and a TP=2 reader of a TP=1 writer's canonical packs receiving only its sections' bytes over the wire."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.redis import require_redis_tools

pytest.importorskip("redis")
torch = pytest.importorskip("torch")

from kvdi.connectors import redis as redis_connector  # noqa: E402
from kvdi.connectors import s3 as s3_connector  # noqa: E402
from kvdi.connectors.base import ConnectorContext, KVConnectorRole  # noqa: E402
from kvdi.connectors.redis import RedisBlockStore, RedisClusterBlockStore  # noqa: E402
from kvdi.connectors.s3 import S3BlockStore, S3Settings  # noqa: E402
from kvdi.connectors.store import StoreWorkerConnector  # noqa: E402
from kvdi.connectors.store.canonical import Section  # noqa: E402
from kvdi.connectors.store.canonical_store import CanonicalBlockStore  # noqa: E402
from kvdi.layout import KVCacheSpec  # noqa: E402
from kvdi.settings import KvdiSettings, RedisSettings  # noqa: E402
from kvdi.testing.redis_server import RedisClusterServers, RedisServer, command  # noqa: E402
from tests.helpers.canonical import HEADS, KEYS, LAYERS, WHOLE, rank_layout, step  # noqa: E402
from tests.helpers.s3 import new_bucket, raw_client, s3_server  # noqa: E402
from tests.helpers.store import make_caches  # noqa: E402

pytestmark = pytest.mark.redis

OBJECT = bytes(range(256)) * 4  # 1 KiB, every byte telling where it lies
ABSENT, KEY = b"\x01" * 16, b"\x02" * 16


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    require_redis_tools()
    with RedisServer() as started:
        yield started


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    require_redis_tools()
    made = RedisClusterServers(masters=3).start()
    yield made
    made.stop()


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with s3_server() as url:
        yield url


Store = RedisBlockStore | RedisClusterBlockStore | S3BlockStore


@pytest.fixture(params=["redis", "cluster", "s3"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each medium's plain store, holding :data:`OBJECT` under :data:`KEY`."""
    prefix = f"{request.node.name}:"
    made: Store
    if request.param == "s3":
        endpoint = request.getfixturevalue("endpoint")
        made = S3BlockStore(S3Settings(bucket=new_bucket(endpoint), endpoint_url=endpoint), len(OBJECT))
    elif request.param == "cluster":
        url = request.getfixturevalue("cluster").url
        made = RedisClusterBlockStore(RedisSettings(url=url, cluster=True, key_prefix=prefix), len(OBJECT))
    else:
        made = RedisBlockStore(RedisSettings(url=request.getfixturevalue("server").url, key_prefix=prefix), len(OBJECT))
    assert made.put_many([(KEY, [OBJECT])]) == 1
    yield made
    made.close()


def pieces(*sizes: int) -> list[memoryview]:
    """Pieces of ``sizes`` bytes, each filled with 0xEE (untouched pieces keep it)."""
    return [memoryview(bytearray(b"\xee" * n)) for n in sizes]


def test_absent_whole_part_and_past_the_end_in_one_call(store: Store) -> None:
    whole, part, tail, past = pieces(128, 896), pieces(5, 1, 30), pieces(40), pieces(8)
    got = store.get_range_into_many(
        [(ABSENT, 0, pieces(4)), (KEY, 0, whole), (KEY, 300, part), (KEY, 1000, tail), (KEY, 2000, past), (KEY, 7, [])]
    )
    beyond = None if isinstance(store, S3BlockStore) else len(OBJECT)  # S3 answers an offset past the end 416
    assert got == [None, len(OBJECT), len(OBJECT), len(OBJECT), beyond, len(OBJECT)]
    assert b"".join(whole) == OBJECT
    assert b"".join(part) == OBJECT[300:336]
    assert bytes(tail[0]) == b"\xee" * 40 and bytes(past[0]) == b"\xee" * 8  # not held: untouched
    assert store.get_range_into_many([]) == []


@pytest.mark.parametrize("store", ["redis", "cluster"], indirect=True)
def test_a_key_holding_no_string_is_an_odd_object_never_an_exception(store: Store) -> None:
    """Redis: a list under the name answers size 0 (what shared_storage answers for a directory); the rest load."""
    assert not isinstance(store, S3BlockStore)
    import redis

    url = store.url.replace("***", "")
    client: Any = redis.RedisCluster.from_url(url) if isinstance(store, RedisClusterBlockStore) else None
    client = client or redis.Redis.from_url(url)
    client.lpush(store.key_prefix + ABSENT.hex(), b"x")
    client.close()
    out = pieces(2)
    assert store.get_range_into_many([(ABSENT, 0, pieces(1)), (KEY, 1, out)]) == [0, len(OBJECT)]
    assert bytes(out[0]) == OBJECT[1:3]


# A TP=2 reader of a TP=1 writer's packs: its range only, over the wire.


class Media:
    """Canonical worker halves over one medium (fresh prefix / bucket), and the bytes its server sent."""

    def __init__(self, kind: str, where: Any, prefix: str) -> None:
        self.kind, self.where, self.prefix = kind, where, prefix
        self.bucket = new_bucket(where) if kind == "s3" else ""
        self.halves: list[StoreWorkerConnector] = []
        self.got = 0  # S3: the body bytes of every GetObject answered; a cluster: the bytes asked by GETRANGE
        for node in where.nodes if kind == "cluster" else []:
            command(node.port, "CONFIG", "SET", "slowlog-log-slower-than", "0")
            command(node.port, "CONFIG", "SET", "slowlog-max-len", "4096")

    def worker(self, layout: KVCacheSpec, seed: int | None = None) -> tuple[StoreWorkerConnector, dict[str, Any]]:
        s = KvdiSettings(kv_role="kv_both", engine_id="test", transfer={"async_save": False, "async_load": "off"})
        if self.kind == "s3":
            options = S3Settings(bucket=self.bucket, endpoint_url=self.where, format="canonical")
            store: Any = s3_connector.open_store(options, layout, s)
            store.inner.client.meta.events.register("after-call.s3.GetObject", self._count)
        else:
            url = self.where.url
            cluster = self.kind == "cluster"
            fields = RedisSettings(url=url, cluster=cluster, key_prefix=self.prefix, format="canonical")
            store = redis_connector.open_store(fields, layout, s)
        half = StoreWorkerConnector(ConnectorContext(self.kind, KVConnectorRole.WORKER, s, layout, None, store))
        caches = make_caches(layout, 16, seed)
        half.register_kv_caches(caches)
        self.halves.append(half)
        return half, caches

    def _count(self, parsed: dict[str, Any], **_: Any) -> None:
        self.got += int(parsed.get("ContentLength") or 0)

    def sent(self) -> int:
        """Bytes the medium has sent so far: Redis, ``total_net_output_bytes``; a cluster (whose bus traffic that
        counts too), the bytes its ``GETRANGE`` commands asked for, from the slow log of every command."""
        if self.kind == "s3":
            return self.got
        if self.kind == "redis":
            info = command(self.where.port, "INFO", "stats")
            assert isinstance(info, bytes)
            line = next(x for x in info.splitlines() if x.startswith(b"total_net_output_bytes:"))
            return int(line.split(b":")[1])
        for node in self.where.nodes:
            logged = command(node.port, "SLOWLOG", "GET", "-1")
            command(node.port, "SLOWLOG", "RESET")
            assert isinstance(logged, list)
            for entry in logged:
                args = entry[3]
                if args[0].upper() == b"GETRANGE":
                    self.got += int(args[3]) - int(args[2]) + 1
        return self.got

    def corrupt_last_byte(self, store: Any, name: bytes) -> None:
        """Flip the last byte of object ``name`` (a payload byte of the pack's last section)."""
        if self.kind == "s3":
            client = raw_client(self.where)
            body = bytearray(client.get_object(Bucket=self.bucket, Key=store.name(name))["Body"].read())
            body[-1] ^= 0x40
            client.put_object(Bucket=self.bucket, Key=store.name(name), Body=bytes(body))
            return
        import redis

        full = self.prefix.encode() + name.hex().encode()
        client: Any = redis.RedisCluster.from_url(self.where.url) if self.kind == "cluster" else None
        client = client or redis.Redis.from_url(self.where.url)
        value = client.get(full)
        client.setrange(full, len(value) - 1, bytes([value[-1] ^ 0x40]))
        client.close()


@pytest.fixture(params=["redis", "cluster", "s3"])
def media(request: pytest.FixtureRequest) -> Iterator[Media]:
    where = request.getfixturevalue({"redis": "server", "cluster": "cluster", "s3": "endpoint"}[request.param])
    made = Media(request.param, where, f"{request.node.name}:")
    yield made
    for half in made.halves:
        half.shutdown()


def test_a_tp2_reader_of_tp1_packs_reads_its_range_only_and_a_bad_section_in_it_misses(media: Media) -> None:
    writer, src = media.worker(WHOLE, seed=7)
    assert step(writer, (0, 1, 2, 3), save=True) == set()
    whole = writer.store
    assert isinstance(whole, CanonicalBlockStore)
    pack = whole.object_bytes  # a pack of both heads, one a TP=2 rank's half of it
    for rank in (1, 0):
        reader, dst = media.worker(rank_layout(rank))
        canonical = reader.store
        assert isinstance(canonical, CanonicalBlockStore)
        first = media.sent()
        before = media.sent()
        info = before - first  # an INFO reply (counted by the next one): what reading the counter costs
        assert step(reader, (5, 6, 7, 8), save=False) == set() and reader.stats.loaded_blocks == 4
        wire = media.sent() - before - info
        assert all(torch.equal(dst[n][5:9], src[n][0:4][:, :, :, rank : rank + 1]) for n in WHOLE.layer_names)
        assert 4 * pack // 2 <= wire < 4 * pack * 3 // 4, (wire, pack)  # half of each pack, not the whole
    inner: Any = canonical.inner
    victim = Section(0, LAYERS, 0, HEADS).key(KEYS[2])  # the TP=1 pack of block 2; its last section is rank 1's
    media.corrupt_last_byte(inner, victim)
    left, _ = media.worker(rank_layout(0))
    assert step(left, (0, 1, 2, 3), save=False) == set()  # rank 0's range holds no bad byte: it loads
    right, dst = media.worker(rank_layout(1))
    sentinel = {n: dst[n][6].clone() for n in dst}
    assert step(right, (4, 5, 6, 7), save=False) == {6, 7}
    assert isinstance(right.store, CanonicalBlockStore) and right.store.misses["checksum"] == 1
    assert all(torch.equal(dst[n][6], sentinel[n]) for n in dst)  # checked before a byte landed
    assert inner.get_range_into_many([(victim, 0, [])]) == [None]  # discarded: a writer may publish it again


def test_a_server_ignoring_the_range_is_cut_and_one_rewriting_between_the_commands_misses() -> None:
    """A ``GETRANGE`` reply longer than the range is never read (a miss, the connection dropped); one shorter than
    ``STRLEN`` promised (the object rewritten between the two commands) is a miss too; the others load."""
    from tests.connectors.test_redis_hostile import ScriptedRedis, bulk

    def script(args: list[bytes], data: dict[bytes, bytes]) -> bytes | None:
        if args[0].upper() == b"GETRANGE" and args[1].endswith(b"aa" * 16):
            return b"$%d\r\n" % (64 << 20)  # a value of 64 MiB announced, never sent
        if args[0].upper() == b"GETRANGE" and args[1].endswith(b"bb" * 16):
            return bulk(b"xy")
        return None

    server = ScriptedRedis(script)
    store = RedisBlockStore(RedisSettings(url=server.url, op_timeout_s=0.5))
    try:
        assert store.put_many([(k, [OBJECT]) for k in (b"\xaa" * 16, b"\xbb" * 16, KEY)]) == 3
        short, good = pieces(8), pieces(8)
        assert store.get_range_into_many([(b"\xbb" * 16, 0, short), (KEY, 8, good)]) == [None, len(OBJECT)]
        assert bytes(short[0]) == b"\xee" * 8 and bytes(good[0]) == OBJECT[8:16]
        cut = store.get_range_into_many([(KEY, 0, pieces(4)), (b"\xaa" * 16, 0, pieces(16)), (KEY, 4, pieces(4))])
        assert cut == [len(OBJECT), None, None] and store.node.cut_replies == 1
        assert store.get_range_into_many([(KEY, 0, good)]) == [len(OBJECT)]  # a fresh connection reads on
    finally:
        store.close()
        server.close()
