"""shared_storage and cpu_offload under hostile input: planted symlinks, odd objects, huge files, modes."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.shared_storage import FileBlockStore, open_store
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.keys import block_keys
from kvdi.errors import ConfigError
from kvdi.settings import SharedStorageSettings, load_settings
from tests.helpers.store import Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))
KEYS = block_keys(PROMPT.prompt_token_ids, LAYOUT)
FRAME = HEADER_SIZE + LAYOUT.block_bytes
IDS = (1, 2, 3, 4, 5)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def open_at(root: Path, **options: object) -> FileBlockStore:
    return open_store(SharedStorageSettings(path=root, **options), LAYOUT, make_settings())  # type: ignore[arg-type]


def produce(store: object) -> None:
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, IDS)  # type: ignore[arg-type]


def consume(store: object) -> tuple[Engine, int, set[int]]:
    engine = Engine(store, LAYOUT, make_settings())  # type: ignore[arg-type]
    n, errors = engine.prefill(PROMPT, IDS)
    return engine, n, errors


def modes(root: Path) -> tuple[set[int], set[int]]:
    """The permission bits of every folder (root included) and of every file under ``root``."""
    entries = [root, *root.rglob("*")]
    dirs = {stat.S_IMODE(p.lstat().st_mode) for p in entries if p.is_dir()}
    files = {stat.S_IMODE(p.lstat().st_mode) for p in entries if p.is_file()}
    return dirs, files


# -- modes -----------------------------------------------------------------------------------------


def test_files_are_private_and_folders_owner_only_under_umask_022(tmp_path: Path, umask_022: None) -> None:
    store = open_at(tmp_path / "kv")
    produce(store)
    assert modes(tmp_path / "kv") == ({0o700}, {0o600})


def test_group_mode_shares_files_and_folders_with_the_group(tmp_path: Path, umask_022: None) -> None:
    store = open_at(tmp_path / "kv", mode=0o640)
    produce(store)
    assert modes(tmp_path / "kv") == ({0o750}, {0o640})


@pytest.mark.parametrize(("raw", "mode"), [("0640", 0o640), ("640", 0o640), ("0o660", 0o660), ("0600", 0o600)])
def test_mode_is_read_as_octal_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str, mode: int) -> None:
    monkeypatch.setenv("KVDI_SHARED_STORAGE__MODE", raw)
    assert load_settings().shared_storage.mode == mode


@pytest.mark.parametrize("raw", ["0777", "0700", "0400", "0o4600", "0060", "rw-r-----", "1e3", "99999"])
def test_bad_mode_is_a_config_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("KVDI_SHARED_STORAGE__MODE", raw)
    with pytest.raises(ConfigError, match="KVDI_SHARED_STORAGE__MODE") as info:
        load_settings()
    assert "0600" in str(info.value)  # says what is allowed


# -- planted symlinks --------------------------------------------------------------------------------


def test_symlinked_fan_out_folders_are_never_written_through(tmp_path: Path) -> None:
    root, outside = tmp_path / "kv", tmp_path / "elsewhere"
    root.mkdir(mode=0o700)
    outside.mkdir()
    for key in KEYS:
        (root / key.hex()[:2]).symlink_to(outside, target_is_directory=True)
    store = FileBlockStore(root, max_bytes=3 * FRAME, object_bytes=FRAME)
    produce(store)
    assert list(outside.iterdir()) == []
    assert not any(p.is_symlink() for p in root.iterdir())  # planted links replaced by real folders
    on_disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert 0 < on_disk <= 3 * FRAME  # the cap counted what was really written, and evicted
    assert store.scan()[1] == on_disk


def test_a_symlinked_fan_out_folder_is_not_read_through(tmp_path: Path) -> None:
    produce(open_at(tmp_path / "real"))
    root = tmp_path / "kv"
    root.mkdir()
    for key in KEYS:
        link = root / key.hex()[:2]
        if not link.is_symlink():
            link.symlink_to(tmp_path / "real" / key.hex()[:2], target_is_directory=True)
    engine, n, errors = consume(open_at(root))
    assert (n, errors, engine.worker.stats.loaded_blocks) == (0, set(), 0)


def test_a_symlinked_store_root_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "kv").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="KVDI_SHARED_STORAGE__PATH.*symlink"):
        open_at(tmp_path / "kv")


# -- odd objects in an object's place ----------------------------------------------------------------

SPARSE = 3 << 30  # 3 GiB, sparse: no disk used


def sparse_file(path: Path) -> None:
    with path.open("wb") as f:
        f.truncate(SPARSE)


def plant(kind: str, path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put something that is not an object where ``path``'s object was."""
    good = path.read_bytes()
    path.unlink()
    if kind == "unix socket":
        monkeypatch.chdir(path.parent)  # a socket path must be short: bind relative to its folder
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path.name)
        sock.close()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink to a valid frame outside":
        (tmp_path / "outside.obj").write_bytes(good)  # following it would load it
        path.symlink_to(tmp_path / "outside.obj")
    elif kind == "symlink loop":
        path.symlink_to(path.name)
    elif kind == "directory":
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "f").write_bytes(b"x")
    elif kind == "3 GiB sparse file":
        sparse_file(path)
    elif kind == "symlink to a 3 GiB sparse file":
        sparse_file(tmp_path / "huge")
        path.symlink_to(tmp_path / "huge")


KINDS = ["unix socket", "fifo", "symlink to a valid frame outside", "symlink loop", "directory",
         "3 GiB sparse file", "symlink to a 3 GiB sparse file"]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("read_into", [True, False], ids=["read-into", "get-many"])
def test_odd_object_is_a_counted_dropped_miss_and_earlier_blocks_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, read_into: bool
) -> None:
    store = open_at(tmp_path / "kv")
    produce(store)
    plant(kind, store.path_for(KEYS[2]), tmp_path, monkeypatch)
    engine = Engine(store, LAYOUT, make_settings())
    engine.worker._read_into = read_into  # both read paths of the worker half
    tracemalloc.start()
    try:
        n, errors = engine.prefill(PROMPT, IDS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (n, errors) == (16, {3, 4})
    assert (engine.worker.stats.loaded_blocks, engine.worker.stats.corrupt_dropped) == (2, 1)
    assert peak < 16 << 20  # bounded: never the 3 GiB
    assert not os.path.lexists(store.path_for(KEYS[2]))  # dropped
    produce(store)  # not poisoned: the next save stores it again and it loads
    assert consume(store)[1:] == (16, set())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=FRAME + 16), st.binary(min_size=FRAME, max_size=FRAME)))
def test_random_bytes_as_an_object_never_raise_and_never_load(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as name:
        store = open_at(Path(name))
        store.path_for(KEYS[0]).parent.mkdir(mode=0o700)
        store.path_for(KEYS[0]).write_bytes(raw)
        engine, n, errors = consume(store)
        assert engine.worker.stats.loaded_blocks == 0
        assert errors == ({1} if n else set())
        store.close()


# -- what a failed call turns into ------------------------------------------------------------------


def test_put_many_returns_how_many_objects_it_wrote(tmp_path: Path) -> None:
    store = open_at(tmp_path / "kv")
    (store.path_for(KEYS[1]) / "squatter").mkdir(parents=True)  # a non-empty folder where an object goes
    assert store.put_many([(k, [bytes(FRAME)]) for k in KEYS[:3]]) == 2


def test_a_partly_written_batch_counts_only_the_failed_objects(tmp_path: Path) -> None:
    store = open_at(tmp_path / "kv")
    (store.path_for(KEYS[1]) / "squatter").mkdir(parents=True)
    engine = Engine(store, LAYOUT, make_settings(role="kv_producer"), seed=1)
    engine.prefill(PROMPT, IDS)
    assert (engine.worker.stats.saved_blocks, engine.worker.stats.save_failures) == (3, 1)


def test_a_closed_store_answers_misses_not_exceptions(tmp_path: Path) -> None:
    store = open_at(tmp_path / "kv")
    produce(store)
    store.close()
    assert store.count_prefix(KEYS) == 0
    assert store.get_many(KEYS[:1]) == [None]
    assert store.get_into_many([(KEYS[0], [memoryview(bytearray(FRAME))])]) == [None]
    assert store.put_many([(KEYS[0], [bytes(FRAME)])]) == 0


@pytest.mark.parametrize(
    "make",
    [lambda: HostPoolStore(1 << 50, FRAME), lambda: HostPoolStore(4, FRAME)],
    ids=["pool-cannot-be-allocated", "pool"],
)
def test_cpu_offload_put_many_counts_what_it_stored(make: Callable[[], HostPoolStore]) -> None:
    store = make()
    items = [(KEYS[0], [bytes(FRAME)]), (KEYS[1], [bytes(FRAME + 1)]), (KEYS[2], [b"x", bytes(FRAME - 1)])]
    expected = 0 if store.num_slots > 1 << 40 else 2  # the oversized object is not kept
    assert store.put_many(items) == expected
    assert store.count_prefix(KEYS) == (1 if expected else 0)


def test_a_lone_surrogate_cache_salt_is_served_and_isolated(tmp_path: Path) -> None:
    store = open_at(tmp_path / "kv")
    salted = request(range(18), "a", salt="tenant-\ud800")
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(salted, IDS)
    assert Engine(store, LAYOUT, make_settings()).prefill(request(range(18), "b", salt="tenant-\ud800"), IDS) == (
        16,
        set(),
    )
    assert Engine(store, LAYOUT, make_settings()).prefill(request(range(18), "c", salt="tenant-\udfff"), IDS)[0] == 0


def test_check_probes_the_folder_and_summarises_it(tmp_path: Path) -> None:
    store = open_at(tmp_path / "kv", mode=0o640)
    assert store.check().startswith(f"shared_storage: {tmp_path / 'kv'} writable, files 0640, folders 0750")
    assert [p.name for p in (tmp_path / "kv").iterdir()] == []  # the probe left nothing behind


def test_a_store_removed_under_a_running_engine_is_recreated_on_the_next_save(tmp_path: Path) -> None:
    store = open_at(tmp_path / "kv")
    produce(store)
    shutil.rmtree(tmp_path / "kv")
    produce(store)
    assert store.count_prefix(KEYS) == 4
    assert consume(store)[1:] == (16, set())
