"""s3 with ``format="canonical"``: each section one object on a real S3 server (moto) on loopback, any TP shape
reads what any wrote, each section verified before a byte lands; absent or corrupt is a counted miss."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

from kvdi.connectors.base import (
    ConnectorContext,
    KVConnectorRole,
)
from kvdi.connectors.s3 import S3BlockStore, S3Settings, open_store
from kvdi.connectors.store import StoreWorkerConnector
from kvdi.connectors.store.canonical import Section
from kvdi.connectors.store.canonical_store import CanonicalBlockStore
from kvdi.errors import ConfigError
from kvdi.layout import KVCacheSpec
from kvdi.settings import KvdiSettings
from tests.helpers.canonical import BS, HEADS, KEYS, LAYERS, WHOLE, rank_layout, step
from tests.helpers.s3 import new_bucket, object_names, raw_client, s3_server
from tests.helpers.store import make_caches


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with s3_server() as url:
        yield url


class Opened:
    """Worker halves over canonical S3 stores of one bucket; all shut down after the test."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint, self.bucket = endpoint, new_bucket(endpoint)
        self.halves: list[StoreWorkerConnector] = []

    def worker(
        self, layout: KVCacheSpec, seed: int | None = None, **extra: Any
    ) -> tuple[StoreWorkerConnector, dict[str, torch.Tensor]]:
        options = S3Settings(bucket=self.bucket, endpoint_url=self.endpoint, format="canonical", **extra)
        s = KvdiSettings(kv_role="kv_both", engine_id="test", transfer={"async_save": False, "async_load": "off"})
        store = open_store(options, layout, s)
        half = StoreWorkerConnector(ConnectorContext("s3", KVConnectorRole.WORKER, s, layout, None, store))
        caches = make_caches(layout, 16, seed)
        half.register_kv_caches(caches)
        self.halves.append(half)
        return half, caches


@pytest.fixture
def opened(endpoint: str) -> Iterator[Opened]:
    o = Opened(endpoint)
    yield o
    for half in o.halves:
        half.shutdown()


def inner(half: StoreWorkerConnector) -> S3BlockStore:
    store = half.store
    assert isinstance(store, CanonicalBlockStore) and isinstance(store.inner, S3BlockStore)
    return store.inner


def test_tp2_ranks_save_sections_and_tp1_and_each_rank_load(opened: Opened) -> None:
    writers = [opened.worker(rank_layout(r), seed=10 + r) for r in range(2)]
    for half, _ in writers:
        assert step(half, (0, 1, 2, 3), save=True) == set() and half.stats.saved_blocks == 4
    assert len(object_names(opened.endpoint, opened.bucket)) == 4 * 2  # one pack a block and rank (here: a head)
    whole, dst = opened.worker(WHOLE)
    assert step(whole, (4, 5, 6, 7), save=False) == set() and whole.stats.loaded_blocks == 4
    for n in WHOLE.layer_names:  # kvdi order [2, N, H, D]
        assert all(torch.equal(dst[n][4:8][:, :, :, r : r + 1], writers[r][1][n][0:4]) for r in range(2))
    reader, got = opened.worker(rank_layout(1, order="hnc"))  # another block order reads the same objects
    assert step(reader, (8, 9, 10, 11), save=False) == set() and reader.stats.loaded_blocks == 4
    for n in WHOLE.layer_names:  # hnc: [H, N, 2D], a token's K then V; rank 1's one head
        src = writers[1][1][n][0:4, :, :, 0]  # [4, 2, N, D]
        assert torch.equal(got[n][8:12].reshape(4, BS, 16), torch.cat([src[:, 0], src[:, 1]], dim=-1))


def test_a_corrupt_or_missing_section_is_a_counted_miss_and_no_byte_of_it_lands(opened: Opened) -> None:
    writer, src = opened.worker(rank_layout(0, order="hnc"), seed=3)  # hnc, a head a section: runs of the cache
    assert step(writer, (0, 1, 2, 3), save=True) == set()
    client = raw_client(opened.endpoint)
    victim = inner(writer).name(Section(0, LAYERS, 0, 1).key(KEYS[1]))
    body = bytearray(client.get_object(Bucket=opened.bucket, Key=victim)["Body"].read())
    body[-1] ^= 0x40  # one payload byte: only the section checksum can tell
    client.put_object(Bucket=opened.bucket, Key=victim, Body=bytes(body))
    client.delete_object(Bucket=opened.bucket, Key=inner(writer).name(Section(0, LAYERS, 0, 1).key(KEYS[3])))
    reader, dst = opened.worker(rank_layout(0, order="hnc"))
    canonical = reader.store
    assert isinstance(canonical, CanonicalBlockStore) and canonical.rank.read_runs == [0]  # straight into the cache
    # a ranged read straight into the cache (as shared_storage's preadv): a bad block's bytes may land, never offered
    assert step(reader, (5, 6, 7, 8), save=False) == {6, 7, 8}
    assert reader.stats.loaded_blocks == 1 and canonical.misses["checksum"] == 1
    assert all(torch.equal(dst[n][5], src[n][0]) for n in dst)
    assert victim not in object_names(opened.endpoint, opened.bucket)  # discarded: a writer may publish it again
    again, _ = opened.worker(rank_layout(0, order="hnc"))
    assert step(again, (5, 6, 7, 8), save=False) == {6, 7, 8}
    assert isinstance(again.store, CanonicalBlockStore) and again.store.misses["absent"] == 2  # blocks 1 and 3


def test_a_per_rank_frame_under_a_section_name_is_an_old_format_miss(opened: Opened) -> None:
    writer, _ = opened.worker(WHOLE, seed=2)
    assert step(writer, (0, 1, 2, 3), save=True) == set()
    from kvdi.connectors.store.framing import frame_header

    name = Section(0, LAYERS, 0, HEADS).key(KEYS[0])  # where the TP=1 writer's pack of block 0 lies
    payload = bytes(WHOLE.block_bytes)
    raw_client(opened.endpoint).put_object(
        Bucket=opened.bucket,
        Key=inner(writer).name(name),
        Body=frame_header(WHOLE.fingerprint(), payload, name=name) + payload,
    )
    reader, _ = opened.worker(rank_layout(0))
    assert step(reader, (5, 6, 7, 8), save=False) == {5, 6, 7, 8}
    assert isinstance(reader.store, CanonicalBlockStore) and reader.store.misses["old_format"] == 1


def test_settings_default_and_refusals(endpoint: str) -> None:
    s = KvdiSettings(kv_role="kv_both", engine_id="test")
    plain = open_store(S3Settings(bucket=new_bucket(endpoint), endpoint_url=endpoint), WHOLE, s)
    assert isinstance(plain, S3BlockStore)  # per_rank stays the default
    plain.close()
    bucket = new_bucket(endpoint)
    with pytest.raises(ConfigError, match="KVDI_S3__COMPRESSION='zstd' with KVDI_S3__FORMAT=canonical"):
        open_store(S3Settings(bucket=bucket, endpoint_url=endpoint, format="canonical", compression="zstd"), WHOLE, s)
    with pytest.raises(ConfigError, match="KVDI_S3__SECTION_LAYERS=3 / __SECTION_HEADS=1"):
        open_store(S3Settings(bucket=bucket, endpoint_url=endpoint, format="canonical", section_layers=3), WHOLE, s)
    canonical = open_store(S3Settings(bucket=bucket, endpoint_url=endpoint, format="canonical"), WHOLE, s)
    assert isinstance(canonical, CanonicalBlockStore) and canonical.prefers_async_load  # S3's: load beside compute
    assert isinstance(canonical.inner, S3BlockStore) and canonical.inner.read_bound == canonical.object_bytes + 65
    canonical.close()
