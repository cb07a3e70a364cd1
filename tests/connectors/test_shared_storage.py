"""shared_storage: a directory of framed objects; every fault is a counted miss, never an exception."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdi.connectors.shared_storage import FileBlockStore, open_store
from kvdi.connectors.store.framing import HEADER_SIZE, frame_header
from kvdi.connectors.store.keys import block_keys
from kvdi.containers import EngineContainer, build_engine_container
from kvdi.errors import ConfigError
from kvdi.layout import KVCacheSpec
from kvdi.settings import SharedStorageSettings
from tests.helpers.store import Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))
KEYS = block_keys(PROMPT.prompt_token_ids, LAYOUT)
REPO_ROOT = str(Path(__file__).resolve().parents[2])  # the child imports tests.helpers from here


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def store(root: Path) -> FileBlockStore:
    store = open_store(SharedStorageSettings(path=root), LAYOUT, make_settings())
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    return store


def consume(store: FileBlockStore, layout: Any = LAYOUT) -> tuple[Engine, int, set[int]]:
    engine = Engine(store, layout, make_settings())
    n, errors = engine.prefill(PROMPT, (1, 2, 3, 4, 5))
    return engine, n, errors


# -- the store itself -------------------------------------------------------------------------


def test_objects_are_files_named_by_hex_key(store: FileBlockStore, root: Path) -> None:
    names = sorted(p.name for p in root.rglob("*") if p.is_file())
    assert names == sorted(k.hex() for k in KEYS)
    assert all(p.stat().st_size == HEADER_SIZE + LAYOUT.block_bytes for p in root.rglob("*") if p.is_file())


def test_objects_survive_a_restart(store: FileBlockStore, root: Path) -> None:
    store.close()
    _, n, errors = consume(open_store(SharedStorageSettings(path=root), LAYOUT, make_settings()))
    assert (n, errors) == (16, set())


def test_uncreatable_directory_is_a_config_error_naming_the_env_var(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="KVDI_SHARED_STORAGE__PATH"):
        open_store(SharedStorageSettings(path=tmp_path / "file" / "kv"), LAYOUT, make_settings())


def test_rewriting_a_key_replaces_the_object_whole(root: Path) -> None:
    store = FileBlockStore(root)
    store.put_many([(b"k" * 16, [b"first"])])
    store.put_many([(b"k" * 16, [b"sec", b"ond!"])])
    assert store.get_many([b"k" * 16]) == [bytearray(b"second!")]
    assert [p.name for p in root.rglob(".*")] == []  # no temp file left behind


def test_max_bytes_evicts_least_recently_used_chain_tail_first(root: Path) -> None:
    frame = HEADER_SIZE + LAYOUT.block_bytes
    store = FileBlockStore(root, max_bytes=6 * frame)
    old, new = request(range(100, 118), "old"), request(range(200, 218), "new")
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(old, (1, 2, 3, 4, 5))
    Engine(store, LAYOUT, make_settings(), seed=2).prefill(new, (1, 2, 3, 4, 5))
    old_keys, new_keys = block_keys(old.prompt_token_ids, LAYOUT), block_keys(new.prompt_token_ids, LAYOUT)
    assert store.count_prefix(new_keys) == 4
    assert 0 < store.count_prefix(old_keys) < 4  # the old chain lost its tail, kept its head
    assert sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) <= 6 * frame


def test_discard_of_an_absent_key_is_fine(root: Path) -> None:
    FileBlockStore(root).discard(b"\x00" * 16)


# -- faults through the real halves ------------------------------------------------------------


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_payload_byte_is_dropped_and_counted(store: FileBlockStore) -> None:
    flip_byte(store.path_for(KEYS[1]), HEADER_SIZE + 100)
    engine, n, errors = consume(store)
    assert (n, errors) == (16, {2, 3, 4})
    assert (engine.worker.stats.corrupt_dropped, engine.worker.stats.loaded_blocks) == (1, 1)
    assert store.count_prefix(KEYS) == 1


def test_truncated_object_is_dropped_and_counted(store: FileBlockStore) -> None:
    path = store.path_for(KEYS[0])
    path.write_bytes(path.read_bytes()[:-1])
    engine, _, errors = consume(store)
    assert errors == {1, 2, 3, 4}
    assert engine.worker.stats.corrupt_dropped == 1
    assert not path.exists()


def test_wrong_format_version_is_dropped_and_counted(store: FileBlockStore) -> None:
    path = store.path_for(KEYS[3])
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 4, 99)
    path.write_bytes(bytes(data))
    engine, _, errors = consume(store)
    assert errors == {4}
    assert engine.worker.stats.corrupt_dropped == 1
    assert store.count_prefix(KEYS) == 3


def test_object_of_a_foreign_layout_under_our_key_is_dropped(store: FileBlockStore) -> None:
    foreign = small_layout(block_size=4, model_id="another-model")  # same size, other fingerprint
    payload = bytes(LAYOUT.block_bytes)
    store.put_many([(KEYS[0], [frame_header(foreign.fingerprint(), payload, name=KEYS[0]), payload])])
    engine, _, errors = consume(store)
    assert errors == {1, 2, 3, 4}
    assert engine.worker.stats.corrupt_dropped == 1


@pytest.mark.parametrize("other", [small_layout(block_size=8), small_layout(dtype="float16")])
def test_same_tokens_under_another_layout_are_a_plain_miss(store: FileBlockStore, other: Any) -> None:
    engine, n, errors = consume(store, other)
    assert (n, errors) == (0, set())
    assert engine.worker.stats.corrupt_dropped == 0
    assert store.count_prefix(KEYS) == 4  # the other layout's objects are left alone


def test_object_replaced_by_a_directory_is_dropped_and_counted(store: FileBlockStore) -> None:
    path = store.path_for(KEYS[2])
    path.unlink()
    (path / "junk").mkdir(parents=True)
    engine, _, errors = consume(store)
    assert errors == {3, 4}
    assert engine.worker.stats.corrupt_dropped == 1
    assert not path.exists()


def test_fifo_in_place_of_an_object_is_dropped_without_hanging(store: FileBlockStore) -> None:
    path = store.path_for(KEYS[0])
    path.unlink()
    os.mkfifo(path)
    engine, _, errors = consume(store)
    assert errors == {1, 2, 3, 4}
    assert engine.worker.stats.corrupt_dropped == 1
    assert not path.exists()


def test_corruption_is_logged_once_per_reason(store: FileBlockStore, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(store, LAYOUT, make_settings())
    with caplog.at_level(logging.WARNING, logger="kvdi.connectors.store"):
        for rid in ("a", "b"):
            flip_byte(store.path_for(KEYS[0]), HEADER_SIZE)
            engine.prefill(request(range(18), rid), (1, 2, 3, 4, 5))
            Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    assert engine.worker.stats.corrupt_dropped == 2
    assert sum("checksum" in r.getMessage() for r in caplog.records) == 1


# -- faults of the medium, in real subprocesses --------------------------------------------------

CHILD = """
import json, resource, sys
from pathlib import Path
from tests.helpers.store import Engine, make_settings, request, small_layout
from kvdi.connectors.shared_storage import FileBlockStore
limit = int(sys.argv[3])
if limit:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
store = FileBlockStore(Path(sys.argv[1]), max_bytes=10**9)
out = {}
for name, tokens in (("stored", range(18)), ("new", range(50, 68))):
    engine = Engine(store, small_layout(), make_settings(), seed=1)
    n, errors = engine.prefill(request(tokens, name), (1, 2, 3, 4, 5))
    out[name] = {"loaded": n, "errors": sorted(errors), **engine.worker.stats.as_dict()}
print(json.dumps(out))
"""


def run_child(root: Path, limit: int = 0, wrap: list[str] | None = None) -> dict[str, Any]:
    argv = [sys.executable, "-c", CHILD, str(root), REPO_ROOT, str(limit)]
    path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}  # the child imports kvdi and tests.helpers from this checkout
    proc = subprocess.run([*(wrap or []), *argv], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def read_only(root: Path) -> Iterator[Callable[[], dict[str, Any]]]:
    """Runs the child with ``root`` read-only: a read-only bind mount (root) or chmod (other users)."""
    if os.geteuid() != 0:
        for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
            d.chmod(0o555)
        yield lambda: run_child(root)
        for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
            d.chmod(0o755)
        return
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-m", "true"], capture_output=True) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("running as root without mount namespaces: cannot make a directory read-only")
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    yield lambda: run_child(root, wrap=[unshare or "unshare", "-m", "sh", "-c", script, "sh", str(root)])


def test_read_only_store_still_loads_and_counts_save_failures(
    store: FileBlockStore, read_only: Callable[[], dict[str, Any]]
) -> None:
    out = read_only()
    assert (out["stored"]["loaded"], out["stored"]["errors"], out["stored"]["loaded_blocks"]) == (16, [], 4)
    assert (out["new"]["save_failures"], out["new"]["saved_blocks"]) == (4, 0)


def test_failing_disk_write_is_a_save_failure(root: Path) -> None:
    root.mkdir()
    out = run_child(root, limit=HEADER_SIZE + LAYOUT.block_bytes // 2)
    assert (out["new"]["save_failures"], out["new"]["saved_blocks"]) == (4, 0)
    assert [p for p in root.rglob("*") if p.is_file()] == []  # no partial object, no temp file


# -- through the reference engine --------------------------------------------------------------

SMALL_MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
               "intermediate_size": 128, "vocab_size": 256, "max_model_len": 512}  # fmt: skip
PROMPTS = [list(range(1, 40)), list(range(7, 30))]


@pytest.fixture
def engine_for(root: Path) -> Iterator[Callable[..., EngineContainer]]:
    built: list[EngineContainer] = []

    def make(connector: str = "shared_storage", **kw: Any) -> EngineContainer:
        settings: dict[str, Any] = {
            "kv_connector": connector,
            "shared_storage": {"path": str(root)},
            "allocator": {"device": "cpu", "num_blocks": 64, "block_size": 4},
            "model": SMALL_MODEL,
            **kw,
        }
        built.append(build_engine_container(**settings))
        return built[-1]

    yield make
    for container in built:
        container.shutdown_resources()


def test_engine_loads_what_another_engine_saved_and_generates_the_same(
    engine_for: Callable[..., EngineContainer],
) -> None:
    expected = [o.output_token_ids for o in engine_for("null").engine().generate(PROMPTS, 4)]
    assert [o.output_token_ids for o in engine_for().engine().generate(PROMPTS, 4)] == expected
    outputs = engine_for().engine().generate(PROMPTS, 4)
    assert [o.output_token_ids for o in outputs] == expected
    assert [o.num_loaded_tokens for o in outputs] == [36, 20]


def corrupt(path: Path, kind: str) -> None:
    """Damage one stored object the way a disk, a bug or another deployment could."""
    data = bytearray(path.read_bytes())
    if kind == "flipped byte":
        data[HEADER_SIZE + 5] ^= 0xFF
    elif kind == "truncated":
        data = data[: len(data) // 2]
    elif kind == "format version":
        struct.pack_into("<H", data, 4, 99)
    elif kind == "foreign layout":
        data[8:24] = small_layout(model_id="other").fingerprint()
    if kind == "directory":
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["flipped byte", "truncated", "format version", "foreign layout", "directory"])
def test_engine_recomputes_a_bad_block_and_generates_the_same(
    engine_for: Callable[..., EngineContainer], root: Path, kind: str
) -> None:
    expected = [o.output_token_ids for o in engine_for().engine().generate(PROMPTS, 4)]
    key = block_keys(PROMPTS[0], KVCacheSpec("kvdi-tiny", 2, 2, 16, 4, "float32"))[3]
    corrupt(FileBlockStore(root).path_for(key), kind)
    engine = engine_for().engine()
    outputs = engine.generate(PROMPTS, 4)
    assert [o.output_token_ids for o in outputs] == expected
    assert [o.num_loaded_tokens for o in outputs] == [12, 20]
    assert engine.connector_stats().total.corrupt_dropped == 1


# -- publishing: anonymous files linked into place, named temp files where the file system lacks O_TMPFILE --


@pytest.mark.parametrize("anonymous", [True, False])
def test_writes_publish_whole_objects_and_leave_no_temp_files(root: Path, anonymous: bool) -> None:
    store = FileBlockStore(root, object_bytes=HEADER_SIZE + LAYOUT.block_bytes)
    store._anonymous = anonymous and store._anonymous  # False: the O_EXCL temp-file-and-rename path
    try:
        for version in (b"\x01", b"\x02"):  # the second write replaces every object
            payload = version * LAYOUT.block_bytes
            items = [(k, [frame_header(LAYOUT.fingerprint(), payload, name=k), payload]) for k in KEYS]
            assert store.put_many(items) == 4
        entries = [p for p in root.rglob("*") if p.is_file()]
        assert len(entries) == 4 and not [p for p in entries if p.name.startswith(".")]
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in entries)
        assert all(bytes(o or b"")[-1:] == b"\x02" for o in store.get_many(KEYS))
        assert consume(store)[1:] == (16, set())
    finally:
        store.close()
