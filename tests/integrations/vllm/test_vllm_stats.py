"""Per-step counter deltas and the kvdi_stats_dir files (kvdi.integrations.vllm.fleet.stats), without vLLM."""

from __future__ import annotations

import json
import os
import stat
import threading
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


def _stats_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvdi-stats-")]


def test_stats_file_writer_writes_from_its_thread_started_on_the_first_moved_step(tmp_path: Path) -> None:
    """No thread until counters move; then the thread writes the file, and stale() never writes it itself."""
    counters = {"saved_blocks": 1}
    callers: list[str] = []

    def read() -> dict[str, int | float]:
        callers.append(threading.current_thread().name)
        return dict(counters)

    writer = StatsFileWriter(str(tmp_path), "e1", "worker", "x", read)
    path = tmp_path / f"e1-worker-{os.getpid()}.json"
    assert not _stats_threads()
    writer.stale()
    assert _read_when(path, 1)["connector"] == "x"
    counters["saved_blocks"] = 7
    writer.stale()
    assert _read_when(path, 7)["saved_blocks"] == 7
    writer.close()
    assert not _stats_threads()
    assert callers[:-1] == ["kvdi-stats-worker"] * (len(callers) - 1) and callers[-1] == "MainThread"


def test_stats_file_writer_coalesces_steps_into_few_writes(tmp_path: Path) -> None:
    """A thousand moved steps while the thread writes give one more write, not a thousand (no queue)."""
    entered, gate, reads = threading.Event(), threading.Event(), [0]

    def read() -> dict[str, int | float]:
        reads[0] += 1
        entered.set()
        gate.wait()
        return {"saved_blocks": reads[0]}

    writer = StatsFileWriter(str(tmp_path), "e1", "worker", "x", read, min_interval_s=0.0)
    writer.stale()
    assert entered.wait(10)  # the thread is writing the first step's counters
    for _ in range(1000):
        writer.stale()
    gate.set()
    _read_when(tmp_path / f"e1-worker-{os.getpid()}.json", 2)  # the first write, then the coalesced one
    writer.close()
    assert reads[0] == 3 and writer.writes == 3  # the last of them is close's final write


def test_stats_file_writer_close_writes_counters_that_moved_without_a_step(tmp_path: Path) -> None:
    """The connector drains kvdi's queued saves, then closes: the final file counts what the drain moved."""
    counters = {"saved_blocks": 1}
    writer = StatsFileWriter(str(tmp_path), "e1", "worker", "x", lambda: dict(counters))
    path = tmp_path / f"e1-worker-{os.getpid()}.json"
    writer.stale()
    _read_when(path, 1)
    counters["saved_blocks"] = 9  # saves that landed during shutdown's drain: no step reported them
    writer.close()
    assert json.loads(path.read_text())["saved_blocks"] == 9
    writer.stale()  # after close: nothing starts again
    assert not _stats_threads()


def test_stats_file_writer_close_writes_the_final_counters(tmp_path: Path) -> None:
    """close() writes the counters as they are then, even when no step marked them stale."""
    writer = StatsFileWriter(str(tmp_path), "e1", "scheduler", "x", lambda: {"saved_blocks": 3})

    writer.close()

    assert _read_when(tmp_path / f"e1-scheduler-{os.getpid()}.json", 3)["connector"] == "x"
