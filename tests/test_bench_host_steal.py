"""The host's steal as the serving benchmarks read it (``benchmarks/vllm/host_steal.py``): /proc/stat's aggregate
line, the share between two readings, and the wait for a quiet host, driven by readings a test hands it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.vllm.host_steal import Jiffies, cpu_jiffies, spin, steal_pct, wait_quiet


def test_the_aggregate_cpu_line_gives_steal_and_the_total(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 800 10 1 4 30 7 0\ncpu0 50 2 25 400 5 0 2 15 0 0\n")
    assert cpu_jiffies(stat) == (30, 190)  # all but idle and iowait; guest (7) is already inside user
    stat.write_text("intr 1 2 3\n")
    assert cpu_jiffies(stat) is None
    stat.write_text("cpu  1 2 3\n")
    assert cpu_jiffies(stat) is None
    assert cpu_jiffies(tmp_path / "absent") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_this_hosts_counters_only_grow() -> None:
    first = cpu_jiffies()
    assert first is not None and 0 <= first[0] <= first[1]
    later = cpu_jiffies()
    assert later is not None and later[1] >= first[1] and 0.0 <= steal_pct(first, later) <= 100.0


def test_the_share_is_of_the_time_between_readings() -> None:
    assert steal_pct((30, 1000), (80, 1200)) == 25.0
    assert steal_pct((30, 1000), (30, 1000)) == 0.0  # no time passed
    assert steal_pct(None, (80, 1200)) == 0.0 and steal_pct((30, 1000), None) == 0.0


def _host(shares: list[float]) -> tuple[list[float], Callable[[], Jiffies], Callable[[float], None]]:
    """Readings whose successive probes see ``shares`` (% of 100 jiffies each), and a busy wait that records each probe's
    length: a probe reads before and after it, the next probe's before is the last one's after."""
    readings = [(0, 0)]
    for share in shares:
        steal, total = readings[-1]
        readings += [(steal + int(share), total + 100)] * 2
    feed = iter(readings)
    probes: list[float] = []
    return probes, lambda: next(feed), probes.append


def test_a_quiet_host_is_not_waited_for_and_a_stolen_one_is_until_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    probes, read, busy = _host([2.0])
    assert wait_quiet(5.0, 60.0, read=read, busy=busy) == 0.0 and probes == [1.0]
    assert capsys.readouterr().err == ""
    probes, read, busy = _host([50.0, 40.0, 3.0])
    assert wait_quiet(5.0, 60.0, read=read, busy=busy) == 2.0 and probes == [1.0, 1.0, 1.0]
    assert "steal up to 50 %, quiet again after 2 s" in capsys.readouterr().err


def test_the_wait_gives_up_after_its_patience_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    probes, read, busy = _host([60.0] * 10)
    assert wait_quiet(5.0, 3.0, read=read, busy=busy) == 3.0 and len(probes) == 4
    assert "steal 60 % after 3 s of waiting; the pass runs anyway" in capsys.readouterr().err


def test_a_probe_keeps_a_cpu_busy_rather_than_sleeping() -> None:
    before = time.process_time()
    spin(0.2)
    assert time.process_time() - before >= 0.02  # a sleep would spend none of this process's CPU time
