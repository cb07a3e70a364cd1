"""What ``kvdi check`` and opening a store refuse or warn about: a Redis that cannot store, a key file
without a secret in it, modes that let others write, a world-writable root, a fan-out folder moved
out of the store. Real redis-server processes and real folders."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store.integrity import frame_key
from kvdi.errors import ConfigError
from kvdi.testing.redis_server import RedisServer
from tests.helpers.store import make_settings

# -- Redis: a probe write and delete --------------------------------------------------------------


@pytest.fixture
def redis_store_on() -> object:
    pytest.importorskip("redis")
    from kvdi.connectors.redis import RedisBlockStore
    from kvdi.settings import RedisSettings

    stores: list[RedisBlockStore] = []

    def make(url: str) -> RedisBlockStore:
        stores.append(RedisBlockStore(RedisSettings(url=url, op_timeout_s=2.0)))
        return stores[-1]

    yield make
    for store in stores:
        store.close()


def test_check_writes_and_deletes_a_probe_on_a_healthy_server(
    redis_server: RedisServer, redis_store_on: object
) -> None:
    import redis

    summary = redis_store_on(redis_server.url).check()  # type: ignore[operator]
    assert "probe write and delete succeeded" in summary
    client = redis.Redis.from_url(redis_server.url)
    assert client.dbsize() == 0  # nothing left behind
    client.close()


def test_check_refuses_a_read_only_replica(redis_server_factory: object, redis_store_on: object) -> None:
    primary = redis_server_factory()  # type: ignore[operator]
    replica = redis_server_factory(extra_args=("--replicaof", "127.0.0.1", str(primary.port)))  # type: ignore[operator]
    with pytest.raises(ConfigError) as info:
        redis_store_on(replica.url).check()  # type: ignore[operator]
    message = str(info.value)
    assert "KVDI_REDIS__URL" in message and "does not store objects" in message and "ReadOnlyError" in message


def test_check_refuses_a_full_server_that_evicts_nothing(redis_server_factory: object, redis_store_on: object) -> None:
    full = redis_server_factory(extra_args=("--maxmemory", "1", "--maxmemory-policy", "noeviction"))  # type: ignore[operator]
    with pytest.raises(ConfigError) as info:
        redis_store_on(full.url).check()  # type: ignore[operator]
    assert "does not store objects" in str(info.value) and "OutOfMemoryError" in str(info.value)


def _check_on(server: RedisServer, frame_bytes: int) -> str:
    from kvdi.connectors.redis import RedisBlockStore
    from kvdi.settings import RedisSettings

    store = RedisBlockStore(RedisSettings(url=server.url, op_timeout_s=2.0), max_object_bytes=frame_bytes)
    try:
        return store.check()
    finally:
        store.close()


@pytest.mark.parametrize(
    ("policy", "frame_bytes", "why"),
    [("noeviction", 8 << 10, "room for fewer than 256 frames"), ("allkeys-lru", 2 << 20, "smaller than one frame")],
    ids=["noeviction-1mb", "too-small-for-a-frame"],
)
def test_check_refuses_a_server_whose_memory_policy_refuses_kvdis_writes(
    redis_server_factory: object, policy: str, frame_bytes: int, why: str
) -> None:
    """``maxmemory 1mb``: a tiny probe is stored, but under noeviction the server is full within a few frames,
    and a 2 MiB frame never fits whatever the policy: kvdi check refuses, saying why."""
    pytest.importorskip("redis")
    server = redis_server_factory(extra_args=("--maxmemory", "1mb", "--maxmemory-policy", policy))  # type: ignore[operator]
    with pytest.raises(ConfigError) as info:
        _check_on(server, frame_bytes)
    message = str(info.value)
    assert "KVDI_REDIS__URL" in message and "maxmemory 1048576 B" in message and why in message


def test_check_warns_about_noeviction_with_room_to_spare(redis_server_factory: object) -> None:
    pytest.importorskip("redis")
    server = redis_server_factory(extra_args=("--maxmemory", "256mb", "--maxmemory-policy", "noeviction"))  # type: ignore[operator]
    summary = _check_on(server, 8 << 10)
    assert "probe write and delete succeeded" in summary and "warning" in summary and "noeviction" in summary


def test_kvdi_check_refuses_a_1mb_noeviction_redis_in_one_line(redis_server_factory: object) -> None:
    """The CLI: exit 2, one line naming KVDI_REDIS__URL and the policy."""
    import subprocess
    import sys

    server = redis_server_factory(extra_args=("--maxmemory", "1mb", "--maxmemory-policy", "noeviction"))  # type: ignore[operator]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDI_")}
    env.update(KVDI_KV_CONNECTOR="redis", KVDI_REDIS__URL=server.url, PYTHONPATH=str(Path(__file__).parents[2]))
    done = subprocess.run(
        [sys.executable, "-m", "kvdi.cli", "check"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "KVDI_REDIS__URL" in done.stderr and "noeviction" in done.stderr


# -- integrity key files without a secret in them --------------------------------------------------


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"\n" * 64, "not whitespace"),
        (b" \t\r\n" * 16, "not whitespace"),
        (b"  short-key  " + b"\n" * 20, "not whitespace"),
        (b"a" * 32 + b"\n", "one repeated byte"),
    ],
    ids=["newlines", "whitespace", "short-word-padded", "repeated-byte"],
)
def test_a_key_file_without_enough_secret_is_refused(tmp_path: Path, content: bytes, why: str) -> None:
    path = tmp_path / "frame.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="KVDI_INTEGRITY_KEY_FILE") as info:
        frame_key(make_settings(integrity_key_file=path))
    assert why in str(info.value)


def test_a_key_value_of_spaces_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError, match="not whitespace") as info:
        frame_key(make_settings(integrity_key=" " * 40 + "x"))
    assert " " * 20 not in str(info.value)


# -- shared_storage: modes, a world-writable root, a fan-out folder moved out ----------------------


def build_store(tmp_path: Path, **storage: object) -> object:
    from kvdi.containers import build_kv_container

    container = build_kv_container(
        kv_connector="shared_storage", shared_storage={"path": str(tmp_path / "kv"), **storage}
    )
    try:
        return container.backend()
    finally:
        container.shutdown_resources()


@pytest.mark.parametrize("mode", ["0606", "0662", "0666"])
def test_modes_that_let_others_write_are_refused(tmp_path: Path, mode: str) -> None:
    with pytest.raises(ConfigError, match=f"KVDI_SHARED_STORAGE__MODE={mode}") as info:
        build_store(tmp_path, mode=mode)
    assert "every user" in str(info.value)
    assert not (tmp_path / "kv").exists()  # refused before anything was created


def test_a_world_writable_root_is_opened_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        build_store(tmp_path)
    assert any("world-writable" in r.getMessage() and "0777" in r.getMessage() for r in caplog.records)
    caplog.clear()
    root.chmod(0o700)
    with caplog.at_level(logging.WARNING):
        build_store(tmp_path)
    assert not any("world-writable" in r.getMessage() for r in caplog.records)


def test_a_fan_out_folder_moved_out_of_the_store_is_not_written_to(tmp_path: Path) -> None:
    store = FileBlockStore(tmp_path / "kv")
    first, second = b"\xab" + bytes(15), b"\xab" + bytes([1] * 15)
    assert store.put_many([(first, [b"one"])]) == 1
    outside = tmp_path / "elsewhere"
    os.rename(tmp_path / "kv" / "ab", outside)  # while the store holds the folder open
    assert store.put_many([(second, [b"two"])]) == 1
    assert sorted(p.name for p in outside.iterdir()) == [first.hex()]  # nothing new outside the store
    assert (tmp_path / "kv" / "ab" / second.hex()).read_bytes() == b"two"
    store.close()
    shutil.rmtree(outside)
