"""Per-step counter deltas and the kvdi_stats_dir files (kvdi.integrations.vllm.fleet.stats), without vLLM."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from kvdi.connectors.base import ConnectorStats
from kvdi.errors import ConfigError
from kvdi.integrations.vllm.fleet.stats import StatsFileWriter, StatsReporter, check_engine_id, write_stats_file


def test_delta_is_none_while_nothing_moves() -> None:
    stats = ConnectorStats()
    reporter = StatsReporter(stats)
    assert reporter.delta() is None
    stats.loaded_blocks += 3
    stats.load_seconds += 0.5
    assert reporter.delta() == {"loaded_blocks": 3, "load_seconds": 0.5}
    assert reporter.delta() is None
    stats.loaded_blocks += 1
    assert reporter.delta() == {"loaded_blocks": 1}


def test_reporter_starts_from_the_counters_it_is_given() -> None:
    stats = ConnectorStats(saved_blocks=5)
    reporter = StatsReporter(stats)
    assert reporter.delta() is None and reporter.as_dict()["saved_blocks"] == 5


def test_stats_file_is_private_and_holds_the_counters(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = write_stats_file(tmp_path / "stats", "e1", "worker", "shared_storage", {"saved_blocks": 4})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "stats").stat().st_mode) == 0o700
    data = json.loads(path.read_text())
    assert data["saved_blocks"] == 4 and data["connector"] == "shared_storage" and data["engine_id"] == "e1"
    assert sorted(p.name for p in (tmp_path / "stats").iterdir()) == [path.name]  # no temp file left


def test_a_planted_symlink_at_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("keep")
    directory = tmp_path / "stats"
    directory.mkdir()
    (directory / f"e1-worker-{os.getpid()}.json").symlink_to(outside)

    path = write_stats_file(directory, "e1", "worker", "x", {"loaded_blocks": 1})

    assert outside.read_text() == "keep"
    assert not path.is_symlink() and json.loads(path.read_text())["loaded_blocks"] == 1


def test_a_symlinked_stats_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(OSError):
        write_stats_file(tmp_path / "link", "e1", "worker", "x", {})
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("engine_id", ["../evil", "a/b", "a\\b", "a\0b", "..", ""])
def test_engine_ids_that_are_not_plain_names_are_config_errors(tmp_path: Path, engine_id: str) -> None:
    with pytest.raises(ConfigError, match="engine_id"):
        check_engine_id(engine_id)
    with pytest.raises(ConfigError, match="engine_id"):
        write_stats_file(tmp_path, engine_id, "worker", "x", {})
    assert list(tmp_path.iterdir()) == []


def _read_when(path: Path, check: object, timeout_s: float = 10.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            data: dict[str, object] = json.loads(path.read_text())
            if data.get("saved_blocks") == check:
                return data
        time.sleep(0.01)
    raise AssertionError(f"{path} never showed saved_blocks={check}")


def test_stats_file_writer_rewrites_the_file_before_stale_returns(tmp_path: Path) -> None:
    """A step whose counters moved leaves the file current when it returns (a killed process loses nothing)."""
    counters = {"saved_blocks": 1}
    writer = StatsFileWriter(str(tmp_path), "e1", "worker", "x", lambda: dict(counters))
    path = tmp_path / f"e1-worker-{os.getpid()}.json"
    writer.stale()
    assert json.loads(path.read_text())["saved_blocks"] == 1
    counters["saved_blocks"] = 7
    writer.stale()
    assert json.loads(path.read_text())["saved_blocks"] == 7


def test_stats_file_writer_close_writes_the_final_counters(tmp_path: Path) -> None:
    """close() writes the counters as they are then, even when no step marked them stale."""
    writer = StatsFileWriter(str(tmp_path), "e1", "scheduler", "x", lambda: {"saved_blocks": 3})

    writer.close()

    assert _read_when(tmp_path / f"e1-scheduler-{os.getpid()}.json", 3)["connector"] == "x"
