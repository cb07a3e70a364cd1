"""The ``s3`` store on a real S3 server (moto) on loopback: the conformance suite, publish-once, planted objects."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

from kvdi.connectors.s3 import S3BlockStore, S3Settings
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.testing.conformance import FRAME_BYTES, KEYS, BlockStoreConformance, Halves, frame
from tests.helpers.s3 import new_bucket, object_names, raw_client, s3_server


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with s3_server() as url:
        yield url


@pytest.fixture
def open_s3(endpoint: str) -> Iterator[Callable[..., S3BlockStore]]:
    """``open(bucket=None, **options)``: a store on a fresh bucket (or ``bucket``); all closed after the test."""
    opened: list[S3BlockStore] = []

    def open_(bucket: str | None = None, frame_bytes: int = FRAME_BYTES, **options: Any) -> S3BlockStore:
        settings = S3Settings(bucket=bucket or new_bucket(endpoint), endpoint_url=endpoint, **options)
        opened.append(S3BlockStore(settings, max_object_bytes=frame_bytes))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


class TestS3Conformance(BlockStoreConformance):
    evicts = False  # capacity and age are the bucket's lifecycle rules (docs/s3.md)

    @pytest.fixture
    def open_block_store(self, open_s3: Callable[..., S3BlockStore]) -> Callable[..., S3BlockStore]:
        return lambda frame_bytes, max_objects=None: open_s3(frame_bytes=frame_bytes)

    def test_an_object_written_twice_holds_the_second_version(self, store: Any) -> None:
        """Overridden: s3 publishes a block once (If-None-Match: *), so the first complete version stays."""
        assert store.put_many([(KEYS[0], [frame(1)])]) == 1
        assert store.put_many([(KEYS[0], [frame(2)])]) == 1  # refused with 412: already published, a success
        got = store.get_many([KEYS[0]])[0]
        assert got is not None and bytes(got) == frame(1)


def test_the_server_refuses_a_second_conditional_create(endpoint: str) -> None:
    """moto honours If-None-Match: * (412 on the second put), so the race tests below test the real condition."""
    import botocore.exceptions

    bucket, client = new_bucket(endpoint), raw_client(endpoint)
    client.put_object(Bucket=bucket, Key="k", Body=b"1", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        client.put_object(Bucket=bucket, Key="k", Body=b"2", IfNoneMatch="*")
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412


def test_two_writers_racing_on_each_block_leave_exactly_one_valid_object(
    endpoint: str, open_s3: Callable[..., S3BlockStore]
) -> None:
    """Two stores (two clients) publish different frames under the same names at once: one object per name, whole."""
    bucket = new_bucket(endpoint)
    writers = [open_s3(bucket), open_s3(bucket)]
    versions = [[frame(100 * w + i) for i in range(len(KEYS))] for w in range(2)]
    start = threading.Barrier(2)
    results: list[int] = []

    def write(w: int) -> None:
        start.wait()
        results.append(
            writers[w].put_many(
                [(k, [o[:HEADER_SIZE], o[HEADER_SIZE:]]) for k, o in zip(KEYS, versions[w], strict=True)]
            )
        )

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [len(KEYS), len(KEYS)]  # both told the block is published
    assert sorted(object_names(endpoint, bucket)) == sorted(writers[0].name(k) for k in KEYS)
    got = writers[0].get_many(KEYS)
    assert all(o is not None and bytes(o) in (versions[0][i], versions[1][i]) for i, o in enumerate(got))


def _planted(kind: str) -> bytes:
    good = frame(7, name=KEYS[1])
    return {
        "truncated": good[:-100],
        "oversize": good * 3,
        "foreign": b"PK\x03\x04" + bytes(len(good) - 4),  # a zip file's start, padded to a frame's size
        "wrong name": frame(7, name=KEYS[2]),  # a valid frame of another block
        "empty": b"",
    }[kind]


@pytest.mark.parametrize("kind", ["truncated", "oversize", "foreign", "wrong name", "empty"])
def test_an_object_planted_by_hand_is_a_counted_miss(
    endpoint: str, open_s3: Callable[..., S3BlockStore], kind: str
) -> None:
    """An object put there by someone else (no condition) never reaches the cache: block 0 loads, the rest recompute."""
    store = open_s3()
    Halves(store, seed=1).prefill()
    raw_client(endpoint).put_object(Bucket=store.bucket, Key=store.name(KEYS[1]), Body=_planted(kind))
    consumer = Halves(store)
    offered, errors = consumer.prefill(block_ids=(6, 7, 8, 9, 10))
    stats = consumer.worker.stats
    assert offered // 4 - len(errors) == 1 and stats.loaded_blocks == 1
    assert stats.corrupt_dropped + stats.load_failures + sum(store.misses.values()) >= 1


def test_an_oversize_object_is_never_read_whole(endpoint: str, open_s3: Callable[..., S3BlockStore]) -> None:
    """A 64-frame object under a block's name: the ranged read returns None and is counted ``oversize``."""
    store = open_s3()
    raw_client(endpoint).put_object(Bucket=store.bucket, Key=store.name(KEYS[0]), Body=frame(1) * 64)
    assert store.get_many([KEYS[0]]) == [None] and store.count_prefix([KEYS[0]]) == 0
    assert store.misses["oversize"] == 2


def test_objects_outside_the_prefix_are_never_touched(endpoint: str, open_s3: Callable[..., S3BlockStore]) -> None:
    """A round trip, discards included, leaves another application's objects in the same bucket as they were."""
    store = open_s3(key_prefix="kvdi/")
    raw_client(endpoint).put_object(Bucket=store.bucket, Key="other/app.bin", Body=b"theirs")
    Halves(store, seed=1).prefill()
    for key in KEYS:
        store.discard(key)
    assert object_names(endpoint, store.bucket) == ["other/app.bin"]


def test_objects_read_ahead_are_the_objects_stored(open_s3: Callable[..., S3BlockStore]) -> None:
    """prefetch() then get_many(): the same bytes as a plain read, and a key never stored still misses."""
    store = open_s3()
    store.put_many([(k, [frame(i)]) for i, k in enumerate(KEYS[:3])])
    assert store.prefetch(KEYS) is True
    got = store.get_many(KEYS)
    assert [bytes(o) if o is not None else None for o in got] == [frame(0), frame(1), frame(2), None]


def test_a_discarded_object_read_ahead_is_not_served(open_s3: Callable[..., S3BlockStore]) -> None:
    """A block read ahead, then discarded (found corrupt elsewhere), is read again from the bucket: absent."""
    store = open_s3()
    store.put_many([(KEYS[0], [frame(0)])])
    store.prefetch([KEYS[0]])
    store.discard(KEYS[0])
    assert store.get_many([KEYS[0]]) == [None]
