"""``kvdi bench storage``'s cpu_offload rows for two checkouts, alternated process by process (A B B A ...).

    python -m benchmarks.offload_ab BEFORE_ROOT AFTER_ROOT [--pairs 4] [--blocks 256] [--repeats 9]

Each run is a fresh process importing kvdi from one root (``PYTHONPATH``) and calling
:func:`kvdi.bench.storage.bench_cpu_offload` (its own rounds alternate kvdi and the one-thread torch copy).
Every run is timed twice: by wall clock, as the bench reports, and by the calling thread's CPU time
(``--cpu``: ``time.thread_time``; everything of these rows runs on that thread with ``io_thread`` off and
torch on one thread), which leaves out the time other processes on a loaded machine take the core away.
Prints each run's ratios, then per root the median of the runs' ratios with their lowest and highest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = ("cpu_offload save", "cpu_offload load")


def one_run(blocks: int, repeats: int, cpu: bool) -> None:  # pragma: no cover - in the child process
    import kvdi.bench.storage as storage

    where = Path(storage.__file__).parents[2]  # the root this process imported kvdi from
    if cpu:
        storage.time = type("Clock", (), {"perf_counter": staticmethod(time.thread_time)})  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        for r in storage.bench_cpu_offload(blocks, repeats, Path(tmp)):
            if r.baseline_name == "torch copy, 1 thread":
                print(f"{r.metric}\t{r.ratio}\t{r.note.rsplit('ratio per round ', 1)[-1]}\t{where}")


def main() -> None:  # pragma: no cover - manual runs
    p = argparse.ArgumentParser()
    p.add_argument("roots", nargs=2)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--child", choices=("wall", "cpu"))
    a = p.parse_args()
    if a.child:
        return one_run(a.blocks, a.repeats, a.child == "cpu")
    names = ("before", "after")
    got: dict[tuple[str, str, str], list[float]] = {}
    for k in range(a.pairs):
        for i in (0, 1) if k % 2 == 0 else (1, 0):
            for clock in ("wall", "cpu"):
                env = {**os.environ, "PYTHONPATH": os.path.abspath(a.roots[i])}
                # Run as a file from a temporary folder: ``-m`` would put the current folder's kvdi first on sys.path.
                args = [sys.executable, str(Path(__file__).resolve()), *a.roots, "--child", clock,
                        "--blocks", str(a.blocks), "--repeats", str(a.repeats)]  # fmt: skip
                with tempfile.TemporaryDirectory() as cwd:
                    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True, cwd=cwd).stdout
                for line in out.splitlines():
                    metric, ratio, spread, where = line.split("\t")
                    if Path(where).resolve() != Path(a.roots[i]).resolve():
                        raise RuntimeError(f"run {k}: kvdi came from {where}, not from {a.roots[i]}")
                    got.setdefault((names[i], clock, metric), []).append(float(ratio))
                    print(f"run {k} {names[i]:6} {clock:4} {metric:16} ratio {float(ratio):.2f} (rounds {spread})")
    print(f"\nmedian of {a.pairs} runs each (each run: median of {a.repeats} rounds of {a.blocks} x 1 MiB blocks)")
    for (name, clock, metric), ratios in sorted(got.items()):
        lo, hi = min(ratios), max(ratios)
        mid = statistics.median(ratios)
        print(f"{name:6} {clock:4} {metric:16} {mid:.2f}x [{lo:.2f}-{hi:.2f}] vs torch copy, 1 thread")


if __name__ == "__main__":  # pragma: no cover
    main()
