"""``kvdi store`` touches only kvdi's objects, and reads at most one frame of any (issue 28, items 1 and 4).

The audit's reproductions: another application's md5-named keys in the same Redis database (with an
empty key prefix, or under kvdi's prefix), another application's files and folders under object names
in a shared_storage folder, and a planted 1 GiB object. ``clear --yes`` and ``verify --drop`` must
leave every foreign entry as it was; ``verify`` of the 1 GiB object costs less than 64 MiB.
"""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdi.admin import clear_store, open_admin, verify_store
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store.framing import HEADER_SIZE, pack_header
from kvdi.settings import load_settings
from kvdi.testing.redis_server import RedisServer
from tests.admin.helpers import frame, key, kvdi

GIB = 1 << 30


def md5_names(count: int = 20) -> list[str]:
    """The 32-hex names another application gives its objects."""
    return [hashlib.md5(f"user:{i}".encode()).hexdigest() for i in range(count)]


# -- Redis ----------------------------------------------------------------------------------------


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[Any]:
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def redis_env(url: str, prefix: str) -> dict[str, str]:
    return {"KVDI_KV_CONNECTOR": "redis", "KVDI_REDIS__URL": url, "KVDI_REDIS__KEY_PREFIX": prefix}


@pytest.mark.redis
@pytest.mark.parametrize("prefix", ["", "app:", "x"], ids=["empty", "app", "one-char"])
def test_foreign_md5_keys_survive_clear_yes_with_any_prefix(
    redis_server: RedisServer, redis_client: Any, prefix: str
) -> None:
    """20 md5-named keys of another application under the prefix (or with no prefix at all) survive
    ``kvdi store clear --yes``; an empty prefix is refused in one line, exit 2, before anything is listed."""
    for name in md5_names():
        redis_client.set(prefix + name, b"another application's value")
    kvdi_key = key(7).hex()
    if prefix:
        redis_client.set(prefix + kvdi_key, frame(7))  # one real kvdi object beside them
    cleared = kvdi("store", "clear", "--yes", env=redis_env(redis_server.url, prefix))
    if prefix:
        assert cleared.returncode == 0, cleared.stderr
        assert "removed 1 objects" in cleared.stdout and "20 foreign entries left alone" in cleared.stdout
        assert not redis_client.exists(prefix + kvdi_key)
    else:
        assert (
            cleared.returncode == 2 and cleared.stderr.count("\n") == 1 and "KVDI_REDIS__KEY_PREFIX" in cleared.stderr
        )
        assert "Traceback" not in cleared.stderr
    assert redis_client.dbsize() == 20
    assert all(redis_client.get(prefix + n) == b"another application's value" for n in md5_names())


@pytest.mark.redis
def test_verify_drop_leaves_foreign_values_and_drops_only_bad_frames(
    redis_server: RedisServer, redis_client: Any
) -> None:
    """Under kvdi's prefix: a foreign value (no frame header) is listed as foreign and kept by ``verify --drop``;
    a truncated kvdi frame is bad and dropped."""
    redis_client.set("kvdi:" + md5_names(1)[0], b"x" * 200)
    redis_client.set("kvdi:" + key(3).hex(), frame(3)[:-5])
    out = kvdi("store", "verify", "--drop", "--json", env=redis_env(redis_server.url, "kvdi:"))
    assert out.returncode == 1, out.stderr
    report = json.loads(out.stdout)
    assert [(b["name"], b["reason"], b["dropped"]) for b in report["bad"]] == [(key(3).hex(), "length", True)]
    assert [f["name"] for f in report["foreign"]] == md5_names(1)
    assert redis_client.get("kvdi:" + md5_names(1)[0]) == b"x" * 200


@pytest.mark.redis
def test_clear_dry_run_lists_what_would_go_and_removes_nothing(redis_server: RedisServer, redis_client: Any) -> None:
    for i in range(3):
        redis_client.set("kvdi:" + key(i).hex(), frame(i))
    redis_client.set("kvdi:" + md5_names(1)[0], b"foreign")
    out = kvdi("store", "clear", "--dry-run", env=redis_env(redis_server.url, "kvdi:"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("would remove: ") == 3 and "would remove 3 objects" in out.stdout
    assert "1 foreign entries left alone" in out.stdout
    assert redis_client.dbsize() == 4


@pytest.mark.redis
def test_verify_of_a_large_redis_value_reads_it_in_bounded_chunks(redis_server: RedisServer, redis_client: Any) -> None:
    """A 96 MiB value with a kvdi header declaring its size is checked in chunks: far less memory than the value."""
    payload_len = 96 << 20
    header = pack_header(bytes(16), key(5), payload_len, 0)
    redis_client.setrange("kvdi:" + key(5).hex(), 0, header)
    redis_client.setrange("kvdi:" + key(5).hex(), HEADER_SIZE + payload_len - 1, b"\0")
    settings = load_settings(kv_connector="redis", redis={"url": redis_server.url})
    admin = open_admin(settings)
    tracemalloc.start()
    try:
        report = verify_store(admin)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        admin.close()
    assert [b.reason for b in report.bad] == ["checksum"]
    assert peak < 32 << 20, f"{peak >> 20} MiB to verify one 96 MiB value"


# -- shared_storage -------------------------------------------------------------------------------


def files_env(root: Path) -> dict[str, str]:
    return {"KVDI_KV_CONNECTOR": "shared_storage", "KVDI_SHARED_STORAGE__PATH": str(root)}


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A store folder with 3 kvdi objects, 20 md5-named files and a md5-named folder of another application."""
    root = tmp_path / "kv"
    store = FileBlockStore(root)
    assert store.put_many([(key(i), [frame(i)]) for i in range(3)]) == 3
    store.close()
    for name in md5_names():
        (root / name[:2]).mkdir(exist_ok=True)
        (root / name[:2] / name).write_bytes(b"another application's file")
    folder = key(9).hex()
    (root / folder[:2]).mkdir(exist_ok=True)
    (root / folder[:2] / folder).mkdir()
    (root / folder[:2] / folder / "data").write_bytes(b"keep me")
    return root


def test_shared_storage_verify_drop_and_clear_leave_foreign_files_and_folders(shared: Path) -> None:
    """verify --drop finds nothing bad and removes nothing; clear --yes removes the 3 kvdi objects only."""
    verify = kvdi("store", "verify", "--drop", "--json", env=files_env(shared))
    assert verify.returncode == 0, verify.stderr
    report = json.loads(verify.stdout)
    assert report["good"] == 3 and report["bad"] == [] and len(report["foreign"]) == 21
    cleared = kvdi("store", "clear", "--yes", env=files_env(shared))
    assert cleared.returncode == 0 and "removed 3 objects" in cleared.stdout
    assert all((shared / n[:2] / n).read_bytes() == b"another application's file" for n in md5_names())
    assert (shared / key(9).hex()[:2] / key(9).hex() / "data").read_bytes() == b"keep me"


def _plant_sparse(root: Path, name: str, header: bytes) -> None:
    os.makedirs(root / name[:2], exist_ok=True)
    with open(root / name[:2] / name, "wb") as out:
        out.write(header)
        out.truncate(GIB)  # sparse: no disk used


@pytest.mark.parametrize("kind", ["foreign", "kvdi-header"])
def test_verify_of_a_planted_1_gib_object_costs_less_than_64_mib(tmp_path: Path, kind: str) -> None:
    """A 1 GiB sparse file under an object's name: with no frame header it is foreign (its header alone read);
    with a header declaring 1 GiB of payload it is read in chunks, never whole."""
    root = tmp_path / "kv"
    FileBlockStore(root).close()
    name = key(4).hex()
    header = b"" if kind == "foreign" else pack_header(bytes(16), key(4), GIB - HEADER_SIZE, 0)
    _plant_sparse(root, name, header)
    admin = open_admin(load_settings(shared_storage={"path": root}))
    tracemalloc.start()
    try:
        report = verify_store(admin, drop=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        admin.close()
    assert peak < 64 << 20, f"{peak >> 20} MiB to verify a 1 GiB object"
    if kind == "foreign":
        assert [f.name for f in report.foreign] == [name] and report.bad == []
        assert (root / name[:2] / name).stat().st_size == GIB  # left alone
    else:
        assert [(b.name, b.reason) for b in report.bad] == [(name, "checksum")]


def test_clear_store_in_a_dry_run_removes_nothing(shared: Path) -> None:
    admin = open_admin(load_settings(shared_storage={"path": shared}))
    try:
        report = clear_store(admin, dry_run=True)
    finally:
        admin.close()
    assert sorted(o.name for o in report.removed) == sorted(key(i).hex() for i in range(3))
    assert len(report.foreign) == 21
    assert all((shared / key(i).hex()[:2] / key(i).hex()).exists() for i in range(3))
