"""The optional integrity key: where it comes from, and forged frames on the real stores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store import BlockStore
from kvdi.connectors.store.framing import HEADER_SIZE, frame_header
from kvdi.connectors.store.integrity import frame_key
from kvdi.connectors.store.keys import block_keys
from kvdi.errors import ConfigError
from kvdi.settings import load_settings
from tests.helpers.store import Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))
KEYS = block_keys(PROMPT.prompt_token_ids, LAYOUT)
SECRET = "correct horse battery staple"
FRAME = HEADER_SIZE + LAYOUT.block_bytes


# -- where the key comes from ----------------------------------------------------------------------


def key_file(tmp_path: Path, content: bytes = SECRET.encode() + b"\n", mode: int = 0o600) -> Path:
    path = tmp_path / "frame.key"
    path.write_bytes(content)
    path.chmod(mode)
    return path


def test_no_key_by_default() -> None:
    assert frame_key(make_settings()) is None


def test_key_from_the_environment_is_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_INTEGRITY_KEY", SECRET)
    settings = load_settings()
    assert SECRET not in repr(settings) and SECRET not in str(settings.model_dump())
    assert frame_key(settings) is not None


def test_key_file_gives_the_same_key_as_the_value(tmp_path: Path) -> None:
    payload = bytes(16)
    from_file = frame_key(make_settings(integrity_key_file=key_file(tmp_path)))
    from_value = frame_key(make_settings(integrity_key=SECRET))
    assert frame_header(bytes(16), payload, from_file, name=b"k" * 16) == frame_header(
        bytes(16), payload, from_value, name=b"k" * 16
    )


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: key_file(p, mode=0o640), "mode 0640"),
        (lambda p: key_file(p, mode=0o604), "mode 0604"),
        (lambda p: key_file(p, content=b"short\n"), "at least 16 bytes"),
        (lambda p: p / "missing.key", "No such file"),
        (lambda p: p, "not a regular file"),
    ],
    ids=["group-readable", "world-readable", "too-short", "missing", "a-directory"],
)
def test_unusable_key_file_is_a_config_error_naming_the_variable(tmp_path: Path, setup: object, message: str) -> None:
    path = setup(tmp_path)  # type: ignore[operator]
    with pytest.raises(ConfigError, match="KVDI_INTEGRITY_KEY_FILE") as info:
        frame_key(make_settings(integrity_key_file=path))
    assert message in str(info.value)


def test_symlinked_key_file_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "link.key"
    link.symlink_to(key_file(tmp_path))
    with pytest.raises(ConfigError, match="KVDI_INTEGRITY_KEY_FILE.*symlink"):
        frame_key(make_settings(integrity_key_file=link))


def test_key_and_key_file_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        frame_key(make_settings(integrity_key=SECRET, integrity_key_file=key_file(tmp_path)))


def test_short_key_value_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError, match="KVDI_INTEGRITY_KEY") as info:
        frame_key(make_settings(integrity_key="tiny-secret"))
    assert "tiny-secret" not in str(info.value)


# -- forged frames on the real stores ---------------------------------------------------------------


@pytest.fixture(params=["shared_storage", "cpu_offload"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlockStore]:
    made: BlockStore
    if request.param == "shared_storage":
        made = FileBlockStore(tmp_path / "kv", object_bytes=FRAME)
    else:
        made = HostPoolStore(16, FRAME)
    yield made
    made.close()


def forge(store: BlockStore, key: bytes) -> bytes:
    """What a writer with access to the store but not the key can do: a well-framed object of its choosing."""
    payload = b"\x7f" * LAYOUT.block_bytes
    store.put_many([(key, [frame_header(LAYOUT.fingerprint(), payload, name=key), payload])])
    return payload


def test_forged_frame_is_loaded_without_a_key(store: BlockStore) -> None:
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    forge(store, KEYS[1])
    engine = Engine(store, LAYOUT, make_settings())
    assert engine.prefill(PROMPT, (1, 2, 3, 4, 5)) == (16, set())
    assert bytes(engine.caches[LAYOUT.layer_names[0]][2].numpy().tobytes()) == b"\x7f" * LAYOUT.layer_block_bytes


def test_forged_frame_is_a_counted_miss_with_a_key(store: BlockStore) -> None:
    Engine(store, LAYOUT, make_settings(integrity_key=SECRET), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    forge(store, KEYS[1])
    engine = Engine(store, LAYOUT, make_settings(integrity_key=SECRET))
    n, errors = engine.prefill(PROMPT, (1, 2, 3, 4, 5))
    assert (n, errors) == (16, {2, 3, 4})  # block 0 (genuine) loaded, the forged one and those after recomputed
    assert (engine.worker.stats.loaded_blocks, engine.worker.stats.corrupt_dropped) == (1, 1)
    assert store.count_prefix(KEYS) == 1  # the forged object was dropped


def test_frames_of_another_key_are_misses_and_keyed_frames_load_without_a_key(store: BlockStore) -> None:
    Engine(store, LAYOUT, make_settings(integrity_key="another key, 16+ bytes"), seed=1).prefill(
        PROMPT, (1, 2, 3, 4, 5)
    )
    assert Engine(store, LAYOUT, make_settings()).prefill(PROMPT, (1, 2, 3, 4, 5)) == (16, set())
    engine = Engine(store, LAYOUT, make_settings(integrity_key=SECRET))
    assert engine.prefill(PROMPT, (1, 2, 3, 4, 5)) == (16, {1, 2, 3, 4})
    assert engine.worker.stats.corrupt_dropped == 1


def test_keyed_engine_round_trips_its_own_blocks(store: BlockStore) -> None:
    producer = Engine(store, LAYOUT, make_settings(integrity_key=SECRET), seed=1)
    producer.prefill(PROMPT, (1, 2, 3, 4, 5))
    consumer = Engine(store, LAYOUT, make_settings(integrity_key=SECRET))
    assert consumer.prefill(PROMPT, (6, 7, 8, 9, 10)) == (16, set())
    for a, b in zip(producer.block(1), consumer.block(6), strict=True):
        assert a.equal(b)


def test_bench_reports_the_keyed_mac_cost_as_a_ratio_to_the_checksum() -> None:
    from kvdi.bench.integrity import bench_frames

    rows = bench_frames(num_blocks=2, repeats=1)
    assert [r.metric for r in rows] == ["frame save", "frame load"]
    assert all(r.baseline_name == "unkeyed xxh3 checksum" and r.ratio == round(r.kvdi / r.baseline, 3) for r in rows)


@pytest.mark.parametrize("connector", ["shared_storage", "cpu_offload"])
def test_building_the_backend_reports_a_bad_key_file(tmp_path: Path, connector: str) -> None:
    from kvdi.containers import build_kv_container

    container = build_kv_container(
        kv_connector=connector,
        shared_storage={"path": str(tmp_path / "kv")},
        integrity_key_file=str(key_file(tmp_path, mode=0o644)),
    )
    with pytest.raises(ConfigError, match="KVDI_INTEGRITY_KEY_FILE"):
        container.backend()
