"""The BlockStore conformance suite (kvdi.testing.conformance) against every built-in store and the docs' example.

shared_storage, cpu_offload, multi over both, Redis on a real redis-server, Redis Cluster on a
real 3-master cluster, and the SQLite store of docs/store-backend.md, run from the page's own
code block (so the page's example is what passes).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.multi import TieredStore
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store import BlockStore
from kvdi.containers import build_kv_container
from kvdi.testing.conformance import BlockStoreConformance, Halves
from kvdi.testing.redis_server import RedisClusterServers, RedisServer
from tests.helpers.docs_example import DOC, docs_example_module
from tests.helpers.redis import require_redis_tools

ROOT = Path(__file__).resolve().parents[2]

Opener = Callable[..., BlockStore]


def closing(make: Callable[[int, int | None], BlockStore]) -> Iterator[Opener]:
    """An ``open_block_store`` fixture body: every store it opened is closed after the test."""
    opened: list[BlockStore] = []

    def open_(frame_bytes: int, max_objects: int | None = None) -> BlockStore:
        opened.append(make(frame_bytes, max_objects))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


class TestSharedStorage(BlockStoreConformance):
    @pytest.fixture
    def open_block_store(self, tmp_path: Path) -> Iterator[Opener]:
        def make(frame: int, cap: int | None) -> BlockStore:
            return FileBlockStore(tmp_path / uuid.uuid4().hex, cap and cap * frame, object_bytes=frame)

        yield from closing(make)


class TestCpuOffload(BlockStoreConformance):
    @pytest.fixture
    def open_block_store(self) -> Iterator[Opener]:
        yield from closing(lambda frame, cap: HostPoolStore(cap or 64, frame))


class TestMulti(BlockStoreConformance):
    @pytest.fixture
    def open_block_store(self, tmp_path: Path) -> Iterator[Opener]:
        def make(frame: int, cap: int | None) -> BlockStore:
            disk = FileBlockStore(tmp_path / uuid.uuid4().hex, cap and cap * frame, object_bytes=frame)
            return TieredStore([("cpu_offload", HostPoolStore(cap or 64, frame)), ("shared_storage", disk)])

        yield from closing(make)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """One real redis-server for the module; every store gets its own key prefix."""
    pytest.importorskip("redis")
    require_redis_tools()
    with RedisServer() as server:
        yield server.url


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    """One real 3-master Redis Cluster for the module; every store gets its own key prefix."""
    pytest.importorskip("redis")
    require_redis_tools()
    with RedisClusterServers(masters=3) as cluster:
        yield cluster.url


def _redis_opener(url: str, cluster: bool) -> Callable[[int, int | None], BlockStore]:
    from kvdi.connectors.redis import FRAME_ROOM, RedisBlockStore, RedisClusterBlockStore
    from kvdi.settings import RedisSettings

    def make(frame: int, _cap: int | None) -> BlockStore:
        options = RedisSettings.model_validate({"url": url, "cluster": cluster, "key_prefix": f"{uuid.uuid4().hex}:"})
        kind = RedisClusterBlockStore if cluster else RedisBlockStore
        return kind(options, max_object_bytes=frame + FRAME_ROOM)

    return make


@pytest.mark.redis
class TestRedis(BlockStoreConformance):
    evicts = False  # Redis evicts by its own maxmemory policy and TTLs

    @pytest.fixture
    def open_block_store(self, redis_url: str) -> Iterator[Opener]:
        yield from closing(_redis_opener(redis_url, cluster=False))


@pytest.mark.redis
class TestRedisCluster(BlockStoreConformance):
    evicts = False

    @pytest.fixture
    def open_block_store(self, cluster_url: str) -> Iterator[Opener]:
        yield from closing(_redis_opener(cluster_url, cluster=True))


# -- the example of docs/store-backend.md, from the page alone -----------------------------------


@pytest.fixture(scope="module")
def example_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with docs_example_module(tmp_path_factory.mktemp("example")) as module:
        yield module


class TestDocsExampleStore(BlockStoreConformance):
    @pytest.fixture
    def open_block_store(self, example_module: Any, tmp_path: Path) -> Iterator[Opener]:
        def make(frame: int, cap: int | None) -> BlockStore:
            store: BlockStore = example_module.SqliteBlockStore(tmp_path / f"{uuid.uuid4().hex}.sqlite3", frame, cap)
            return store

        yield from closing(make)


def test_the_docs_example_is_a_connector_through_its_module_path(
    example_module: Any, kvdi_env: Path, tmp_path: Path
) -> None:
    """Selected by name and module path as the page says, options from extra config, halves round-trip."""
    c = build_kv_container(
        kv_connector="sqlite",
        kv_connector_module_path=example_module.__name__,
        kv_connector_extra_config={"path": str(tmp_path / "kv.sqlite3"), "max_objects": 100},
        engine_id="docs",
    )
    try:
        assert c.connector().is_store and c.connector().origin == "module-path"
        store = c.backend()
        assert type(store).__name__ == "SqliteBlockStore" and store.max_objects == 100
    finally:
        c.shutdown_resources()


def test_the_docs_example_reports_through_kvdi_check(example_module: Any, tmp_path: Path) -> None:
    folder = Path(example_module.__file__).parent
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDI_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]),
        KVDI_KV_CONNECTOR="sqlite",
        KVDI_KV_CONNECTOR_MODULE_PATH=example_module.__name__,
        KVDI_KV_CONNECTOR_EXTRA_CONFIG=f'{{"path": "{tmp_path / "c.sqlite3"}"}}',
    )
    done = subprocess.run([sys.executable, "-m", "kvdi.cli", "check"], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "sqlite: 0 objects" in done.stdout


def test_halves_over_the_example_store_load_what_they_saved(example_module: Any, tmp_path: Path) -> None:
    from kvdi.testing.conformance import FRAME_BYTES

    store = example_module.SqliteBlockStore(tmp_path / "kv.sqlite3", FRAME_BYTES)
    try:
        Halves(store, seed=3).prefill()
        assert Halves(store).prefill(block_ids=(6, 7, 8, 9, 10)) == (16, set())
    finally:
        store.close()


def test_the_docs_capability_table_lists_exactly_the_declared_capabilities() -> None:
    """docs/store-backend.md's table names each member of every optional capability protocol, and no other."""
    from kvdi.connectors.store.protocol import OPTIONAL_CAPABILITIES

    declared = set()
    for protocol in OPTIONAL_CAPABILITIES:
        declared |= set(getattr(protocol, "__annotations__", {}))
        declared |= {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    table = DOC.read_text().split("| capability | for | default |", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)", table, re.M))
    assert documented == declared, f"only in the docs: {documented - declared}; undocumented: {declared - documented}"
