"""``kvdi store stats|verify|clear`` on an ``s3`` bucket: only kvdi's objects under the prefix, recognised by content."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from kvdi.connectors.s3 import S3BlockStore, S3Settings
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.testing.conformance import FRAME_BYTES, KEYS, Halves
from tests.helpers.s3 import CREDENTIALS, new_bucket, object_names, raw_client, s3_server

ROOT = Path(__file__).resolve().parents[2]
FOREIGN = "kvdi/" + "ab" * 16  # a block's name holding another application's bytes
OTHER = "kvdi/notes.txt"  # under the prefix, not a block's name
OUTSIDE = "other-app/data.bin"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with s3_server() as url:
        yield url


@pytest.fixture
def bucket(endpoint: str) -> str:
    """A bucket with 4 blocks of a real producer, one corrupt block, a foreign object, an other and an outside one."""
    name = new_bucket(endpoint)
    store = S3BlockStore(S3Settings(bucket=name, endpoint_url=endpoint), FRAME_BYTES)
    Halves(store, seed=1).prefill()
    client = raw_client(endpoint)
    good = client.get_object(Bucket=name, Key=store.name(KEYS[0]))["Body"].read()
    flipped = bytearray(good)
    flipped[HEADER_SIZE + 3] ^= 1
    client.put_object(Bucket=name, Key=store.name(KEYS[3]), Body=bytes(flipped))
    client.put_object(Bucket=name, Key=FOREIGN, Body=b"not a frame at all" * 10)
    client.put_object(Bucket=name, Key=OTHER, Body=b"notes")
    client.put_object(Bucket=name, Key=OUTSIDE, Body=b"theirs")
    store.close()
    return name


def kvdi_store(endpoint: str, bucket: str, *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith(("KVDI_", "AWS_"))}
    env = {**base, **CREDENTIALS, "PYTHONPATH": str(ROOT), "KVDI_KV_CONNECTOR": "s3"}
    env.update(KVDI_S3__BUCKET=bucket, KVDI_S3__ENDPOINT_URL=endpoint)
    return subprocess.run(
        [sys.executable, "-m", "kvdi.cli", "store", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_stats_counts_kvdi_objects_and_shows_the_s3_settings(endpoint: str, bucket: str) -> None:
    """Four frames and the corrupt one are kvdi's by content; the foreign object and the other name are not."""
    r = kvdi_store(endpoint, bucket, "stats", "--json")
    assert r.returncode == 0, r.stderr
    info: dict[str, Any] = json.loads(r.stdout)
    assert info["objects"] == 4 and info["settings"]["s3"]["bucket"] == bucket
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in r.stdout + r.stderr


def test_stats_shows_the_lifecycle_rule_that_expires_the_prefix(endpoint: str, bucket: str) -> None:
    """A bucket rule expiring ``kvdi/`` after 3 days is what bounds the store's age: stats shows it."""
    rule = {"ID": "kvdi-expiry", "Filter": {"Prefix": "kvdi/"}, "Status": "Enabled", "Expiration": {"Days": 3}}
    raw_client(endpoint).put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": [rule]})
    r = kvdi_store(endpoint, bucket, "stats", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["server"]["expiry_rules"] == [{"id": "kvdi-expiry", "prefix": "kvdi/", "days": 3}]


def test_verify_drop_removes_only_the_corrupt_frame(endpoint: str, bucket: str) -> None:
    """verify --drop: exit 1, the corrupt block removed; the foreign, other and outside objects are left alone."""
    r = kvdi_store(endpoint, bucket, "verify", "--drop")
    assert r.returncode == 1, r.stderr
    names = set(object_names(endpoint, bucket))
    assert "kvdi/" + KEYS[3].hex() not in names and {FOREIGN, OTHER, OUTSIDE} <= names
    assert len(names) == 6


def test_clear_removes_every_kvdi_object_and_nothing_else(endpoint: str, bucket: str) -> None:
    """clear --yes: the bucket keeps the foreign object under a block's name, the other name and the outside one."""
    r = kvdi_store(endpoint, bucket, "clear", "--yes")
    assert r.returncode == 0, r.stderr
    assert sorted(object_names(endpoint, bucket)) == sorted([FOREIGN, OTHER, OUTSIDE])


def test_verify_accepts_compressed_frames_and_drops_a_corrupted_one(endpoint: str) -> None:
    """A bucket written with compression zstd: verify finds the 3 intact compressed frames good, the flipped one bad."""
    from kvdi.connectors.store.codec import compressor_for
    from kvdi.connectors.store.framing import FLAG_ZSTD, frame_codec

    name = new_bucket(endpoint)
    store = S3BlockStore(S3Settings(bucket=name, endpoint_url=endpoint), FRAME_BYTES)
    store.compressor = compressor_for("zstd", None, "compression")
    Halves(store, seed=None).prefill()  # zeros: every block compressed
    client = raw_client(endpoint)
    stored = bytearray(client.get_object(Bucket=name, Key=store.name(KEYS[1]))["Body"].read())
    assert frame_codec(stored[:HEADER_SIZE]) == FLAG_ZSTD and len(stored) < FRAME_BYTES // 2
    stored[-2] ^= 1
    client.delete_object(Bucket=name, Key=store.name(KEYS[1]))
    client.put_object(Bucket=name, Key=store.name(KEYS[1]), Body=bytes(stored))
    store.close()
    r = kvdi_store(endpoint, name, "verify", "--drop")
    assert r.returncode == 1, r.stderr
    assert sorted(object_names(endpoint, name)) == sorted(f"kvdi/{k.hex()}" for k in (KEYS[0], KEYS[2], KEYS[3]))
