"""The hypervisor's share of this machine's CPU time (steal), read from ``/proc/stat``.

Why: the benchmark host is a virtual machine with 2 vCPUs. When other guests on the same physical machine are busy,
the hypervisor runs them while our runnable threads wait, and Linux counts that time as *steal*. At 04:27 UTC on
2026-12-07 steal was 50-60 % of the CPU time for minutes, and a step of vLLM took 4-10 times as long: a pass that meets
such a stretch in one mode only moves a kvdi / noop ratio far more than issue 31's bars. So
:mod:`.bench_serve_switch` records each pass's steal, waits for a quiet host before a pass (:func:`wait_quiet`)
and runs a pass again that met more steal than its bound (``docs/bench-serve-power.md``, round thirteen).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

Jiffies = tuple[int, int] | None
"""(steal, wanted) jiffies of all CPUs since boot, ``wanted`` being the time the machine wanted to run (all but idle
and iowait, steal included); None where ``/proc/stat`` cannot say (another OS). Steal accrues only while a thread is
runnable, so an idle machine sees none however busy its neighbours are: its share is of the wanted time."""


def cpu_jiffies(stat: Path = Path("/proc/stat")) -> Jiffies:
    """:data:`Jiffies` from the aggregate ``cpu`` line: user, nice, system, idle, iowait, irq, softirq, steal (guest
    time is already inside user and nice)."""
    try:
        fields = stat.read_text().split("\n", 1)[0].split()
        values = [int(v) for v in fields[1:9]]
    except (OSError, ValueError):
        return None
    if fields[0] != "cpu" or len(values) < 8:
        return None
    return values[7], sum(values) - values[3] - values[4]


def steal_pct(before: Jiffies, after: Jiffies) -> float:
    """Steal's share (%) of the time the machine wanted to run between two readings; 0.0 where either is None or it
    wanted none."""
    if before is None or after is None or after[1] <= before[1]:
        return 0.0
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


def spin(seconds: float) -> None:
    """Keep one CPU busy for ``seconds``: a probe of an idle machine would see no steal (:data:`Jiffies`)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def wait_quiet(
    bound_pct: float,
    patience_s: float,
    probe_s: float = 1.0,
    read: Callable[[], Jiffies] = cpu_jiffies,
    busy: Callable[[float], None] = spin,
) -> float:
    """Probe the host ``probe_s`` at a time, one CPU kept busy (``busy``), until a probe sees steal at most
    ``bound_pct``, for at most ``patience_s`` of probes; returns the seconds spent probing beyond the first probe
    (0.0: quiet at once). Says so on stderr when it waited, and when it gave up (the pass then runs anyway, its steal
    recorded)."""
    waited, worst = 0.0, 0.0
    while True:
        before = read()
        busy(probe_s)
        share = steal_pct(before, read())
        if share <= bound_pct:
            if waited:
                print(f"  host: steal up to {worst:.0f} %, quiet again after {waited:.0f} s", file=sys.stderr)
            return waited
        worst = max(worst, share)
        if waited >= patience_s:
            print(f"  host: steal {share:.0f} % after {waited:.0f} s of waiting; the pass runs anyway",
                  file=sys.stderr)  # fmt: skip
            return waited
        waited += probe_s
