"""shared_storage publishes each canonical section once (as S3 does); per-rank frames are rewritten as before.
A canonical save hashes each byte once (the sections' checksums), not once more for a per-rank frame header."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kvdi.connectors.base import ConnectorContext, KVConnectorRole
from kvdi.connectors.shared_storage import FileBlockStore, open_store
from kvdi.connectors.store import StoreWorkerConnector, writes
from kvdi.connectors.store.canonical import Section
from kvdi.connectors.store.canonical_store import CanonicalBlockStore
from kvdi.layout import KVCacheSpec
from kvdi.settings import KvdiSettings
from tests.helpers.canonical import HEADS, KEYS, LAYERS, WHOLE, step
from tests.helpers.store import make_caches

SECTION = Section(0, LAYERS, 0, HEADS)  # the TP=1 writer's pack of a block (both heads, every layer)
CACHES: dict[StoreWorkerConnector, dict[str, torch.Tensor]] = {}


def worker(
    root: Path, fmt: str, seed: int, layout: KVCacheSpec = WHOLE, max_bytes: int | None = None
) -> StoreWorkerConnector:
    """A worker half of its own (a new engine: nothing saved yet) over the store at ``root``."""
    options = {"path": str(root), "format": fmt, "max_bytes": max_bytes}
    s = KvdiSettings(kv_role="kv_both", engine_id="t", shared_storage=options)
    store = open_store(s.shared_storage, layout, s)
    half = StoreWorkerConnector(ConnectorContext("shared_storage", KVConnectorRole.WORKER, s, layout, None, store))
    CACHES[half] = make_caches(layout, 16, seed)
    half.register_kv_caches(CACHES[half])
    return half


def section_path(half: StoreWorkerConnector, block: int) -> Path:
    store = half.store
    assert isinstance(store, CanonicalBlockStore) and isinstance(store.inner, FileBlockStore)
    return store.inner.path_for(SECTION.key(KEYS[block]))


def test_a_stored_section_is_not_written_again(tmp_path: Path) -> None:
    first = worker(tmp_path, "canonical", seed=1)
    assert step(first, (0, 1, 2, 3), save=True) == set()
    path = section_path(first, 2)
    before = path.stat()
    second = worker(tmp_path, "canonical", seed=2)  # other bytes under the same names: the first copy stays
    assert step(second, (0, 1, 2, 3), save=True) == set()
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    reader = worker(tmp_path, "canonical", seed=3)
    assert step(reader, (4, 5, 6, 7), save=False) == set()
    written, loaded = CACHES[first], CACHES[reader]
    assert all(torch.equal(written[n][:4], loaded[n][4:8]) for n in written)  # the first writer's bytes


def test_per_rank_frames_are_still_rewritten(tmp_path: Path) -> None:
    first = worker(tmp_path, "per_rank", seed=1)
    step(first, (0, 1, 2, 3), save=True)
    store = first.store
    assert isinstance(store, FileBlockStore) and not store.publish_once
    before = store.path_for(KEYS[2]).stat().st_ino
    step(worker(tmp_path, "per_rank", seed=2), (0, 1, 2, 3), save=True)
    assert store.path_for(KEYS[2]).stat().st_ino != before


def test_an_odd_or_too_open_file_under_a_section_name_is_replaced(tmp_path: Path) -> None:
    half = worker(tmp_path, "canonical", seed=1)
    step(half, (0, 1, 2, 3), save=True)
    short, loose = section_path(half, 1), section_path(half, 2)
    short.write_bytes(b"x" * 10)  # not the size of a section
    loose.chmod(0o644)  # wider than the store's 0600: not as private as ours
    step(worker(tmp_path, "canonical", seed=1), (0, 1, 2, 3), save=True)
    size = half.store.object_bytes  # type: ignore[union-attr]
    assert short.stat().st_size == size
    assert loose.stat().st_mode & 0o777 == 0o600
    assert step(worker(tmp_path, "canonical", seed=3), (4, 5, 6, 7), save=False) == set()


def test_a_bad_section_is_dropped_by_its_reader_and_the_next_save_writes_it(tmp_path: Path) -> None:
    half = worker(tmp_path, "canonical", seed=1)
    step(half, (0, 1, 2, 3), save=True)
    path = section_path(half, 2)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the right size, a wrong byte: kept by a save, never loaded
    path.write_bytes(bytes(raw))
    step(worker(tmp_path, "canonical", seed=1), (0, 1, 2, 3), save=True)
    reader = worker(tmp_path, "canonical", seed=3)
    assert step(reader, (4, 5, 6, 7), save=False) == {6, 7}
    assert reader.store.misses["checksum"] == 1  # type: ignore[union-attr]
    assert not path.exists()  # dropped by the reader
    step(worker(tmp_path, "canonical", seed=1), (0, 1, 2, 3), save=True)
    assert step(worker(tmp_path, "canonical", seed=4), (4, 5, 6, 7), save=False) == set()


def test_a_canonical_save_frames_sections_only_not_the_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    framed: list[bytes] = []
    real = writes.frame_header

    def counted(*args: Any, **kwargs: Any) -> bytes:
        framed.append(kwargs["name"])
        return real(*args, **kwargs)

    monkeypatch.setattr(writes, "frame_header", counted)
    assert step(worker(tmp_path / "c", "canonical", seed=1), (0, 1, 2, 3), save=True) == set()
    assert framed == []  # the sections carry their own checksums: no pass over the block for a frame header
    assert step(worker(tmp_path / "c", "canonical", seed=2), (4, 5, 6, 7), save=False) == set()
    assert step(worker(tmp_path / "p", "per_rank", seed=1), (0, 1, 2, 3), save=True) == set()
    assert framed == list(KEYS)  # per-rank frames: one header a block, as before


def test_a_kept_section_is_touched_under_a_size_cap_so_a_hot_prefix_is_evicted_last(tmp_path: Path) -> None:
    step(worker(tmp_path, "canonical", seed=1, max_bytes=1 << 30), (0, 1, 2, 3), save=True)
    path = section_path(worker(tmp_path, "canonical", seed=1), 2)
    os.utime(path, ns=(10**9, 10**9))  # long ago
    inode = path.stat().st_ino
    step(worker(tmp_path, "canonical", seed=2), (0, 1, 2, 3), save=True)  # no cap: kept, not touched
    assert path.stat().st_mtime_ns == 10**9
    step(worker(tmp_path, "canonical", seed=2, max_bytes=1 << 30), (0, 1, 2, 3), save=True)
    assert path.stat().st_mtime_ns > 10**9 and path.stat().st_ino == inode  # kept and touched
