"""``kvdi store stats|verify|clear`` on a real shared_storage folder written by kvdi's own store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvdi.admin import check_object, clear_store, open_admin, store_stats, verify_store
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.settings import load_settings
from tests.admin.helpers import FINGERPRINTS, corruptions, frame, key, kvdi

GOOD = 40


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A folder with GOOD valid objects, three corrupt ones, a symlink in an object's place, a temp file."""
    root = tmp_path / "kv"
    files = FileBlockStore(root)
    assert files.put_many([(key(i), [frame(i)]) for i in range(GOOD)]) == GOOD
    bad = corruptions()
    assert files.put_many([(key(1000 + i), [obj]) for i, obj in enumerate(bad.values())]) == len(bad)
    files.close()
    squat = key(2000).hex()
    (root / squat[:2]).mkdir(exist_ok=True)
    (root / squat[:2] / squat).symlink_to(tmp_path / "elsewhere")
    (root / squat[:2] / f".{squat}.abcd.tmp").write_bytes(b"partial")
    (tmp_path / "elsewhere").write_bytes(b"must survive")
    return root


def env(root: Path) -> dict[str, str]:
    return {"KVDI_KV_CONNECTOR": "shared_storage", "KVDI_SHARED_STORAGE__PATH": str(root)}


KVDI_CORRUPT = {n: r for n, r in corruptions().items() if n != "magic"}  # "magic": no frame header, so foreign
FOREIGN = {key(1001).hex(): "no frame header", key(2000).hex(): "symlink"}


def test_stats_counts_objects_bytes_and_layouts(store: Path) -> None:
    """kvdi objects and bytes in total and per layout fingerprint read from each frame (not per fan-out folder);
    foreign entries (no frame header, a symlink) and temp files are counted apart."""
    admin = open_admin(load_settings(**{"shared_storage": {"path": store}}))
    try:
        stats = store_stats(admin)
    finally:
        admin.close()
    sizes = [len(frame(i)) for i in range(GOOD)] + [len(v) for v in KVDI_CORRUPT.values()]
    assert stats.total.objects == len(sizes) and stats.total.bytes == sum(sizes)
    assert sum(g.objects for g in stats.groups.values()) == len(sizes)
    assert set(stats.groups) == {f.hex() for f in FINGERPRINTS}  # frames alternate between two layouts
    assert stats.groups[FINGERPRINTS[0].hex()].objects == GOOD // 2
    assert stats.odd == 1 and stats.other == 1 and stats.foreign == 2
    assert stats.total.oldest is not None and stats.total.oldest <= stats.total.newest  # type: ignore[operator]


def test_verify_finds_exactly_the_planted_objects_and_drops_them(store: Path) -> None:
    """verify names the corrupt kvdi objects (with their reasons), nothing else; --drop removes them; the
    foreign entries (no frame header, a symlink) are listed and left alone, the link never followed."""
    admin = open_admin(load_settings(**{"shared_storage": {"path": store}}))
    try:
        report = verify_store(admin, drop=True)
        again = verify_store(admin)
    finally:
        admin.close()
    expected = {key(1000 + i).hex(): reason for i, reason in enumerate(corruptions()) if reason != "magic"}
    assert {b.name: b.reason for b in report.bad} == expected
    assert all(b.dropped for b in report.bad)
    assert report.good == GOOD and report.checked == GOOD + len(expected)
    assert {f.name: f.why for f in report.foreign} == FOREIGN
    assert again.bad == [] and again.good == GOOD and len(again.foreign) == 2
    assert (store / key(2000).hex()[:2] / key(2000).hex()).is_symlink()
    assert (store.parent / "elsewhere").read_bytes() == b"must survive"


def test_check_object_accepts_any_layout_and_refuses_a_short_object() -> None:
    assert check_object(frame(1), len(frame(1)), None, key(1).hex()) is None
    assert check_object(frame(2), len(frame(2)), None, key(2).hex()) is None  # another fingerprint: still valid
    assert check_object(frame(1), len(frame(1)), None, key(2).hex()) == "name"  # copied under another name
    assert check_object(b"KVDI", 4, None, key(1).hex()) == "length"
    assert check_object(None, 10, None, key(1).hex()) == "vanished"


def test_clear_removes_objects_and_leaves_other_entries(store: Path) -> None:
    admin = open_admin(load_settings(**{"shared_storage": {"path": store}}))
    try:
        report = clear_store(admin)
        assert len(report.removed) == GOOD + len(KVDI_CORRUPT)
        assert {f.name for f in report.foreign} == set(FOREIGN)  # left alone
        assert store_stats(admin).total.objects == 0
    finally:
        admin.close()
    assert [p.name for p in store.rglob(".*.tmp")]  # a writer's temp file is not kvdi store's to remove
    assert (store.parent / "elsewhere").exists()


def test_cli_stats_json_verify_exit_codes_and_clear(store: Path) -> None:
    """The commands as a user runs them: stats --json with the settings, verify exits 1 then 0 after --drop,
    clear refuses without --yes when not interactive (exit 2, one line) and clears with it."""
    stats = kvdi("store", "stats", "--json", env=env(store))
    assert stats.returncode == 0, stats.stderr
    info = json.loads(stats.stdout)
    assert info["objects"] == GOOD + len(KVDI_CORRUPT) and info["kind"] == "shared_storage"
    assert info["settings"]["shared_storage"]["path"] == str(store)
    table = kvdi("store", "stats", env=env(store))
    assert table.returncode == 0 and "total" in table.stdout and str(GOOD + len(KVDI_CORRUPT)) in table.stdout
    verify = kvdi("store", "verify", env=env(store))
    assert verify.returncode == 1, verify.stderr
    bad = len(KVDI_CORRUPT)
    assert verify.stdout.count("bad: ") == bad and f"{GOOD} good, {bad} bad" in verify.stdout
    dropped = kvdi("store", "verify", "--drop", "--json", env=env(store))
    assert dropped.returncode == 1 and len(json.loads(dropped.stdout)["bad"]) == bad
    assert kvdi("store", "verify", env=env(store)).returncode == 0
    refused = kvdi("store", "clear", env=env(store), stdin="")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "--yes" in refused.stderr
    assert "Traceback" not in refused.stderr
    cleared = kvdi("store", "clear", "--yes", env=env(store))
    assert cleared.returncode == 0 and f"removed {GOOD} objects" in cleared.stdout


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    """A missing folder and a connector without a shared store: exit 2, one line naming the setting."""
    missing = kvdi("store", "stats", env=env(tmp_path / "absent"))
    assert missing.returncode == 2 and "KVDI_SHARED_STORAGE__PATH" in missing.stderr
    assert missing.stderr.count("\n") == 1
    local = kvdi("store", "stats", env={"KVDI_KV_CONNECTOR": "cpu_offload"})
    assert local.returncode == 2 and "KVDI_KV_CONNECTOR='cpu_offload'" in local.stderr
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    assert kvdi("store", "stats", env=env(link)).returncode == 2
    assert os.path.islink(link)
