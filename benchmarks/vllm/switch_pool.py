"""Pool the rounds of several ``bench_serve_switch`` runs of the same code: more rounds, narrower intervals.

Usage (any venv with numpy, from the repository root)::

    python -m benchmarks.vllm.switch_pool benchmarks/results/bench_serve_switch-null-*.txt [...]

A round of :mod:`.bench_serve_switch` stands alone: both modes ran on one server, on the same prompts, seconds
apart, so its kvdi / noop ratio is one sample of kvdi's cost whatever the machine did before or after. Rounds of
runs that measured the same code can therefore be pooled. A run is taken only when:

- it is a results file of the benchmark (``benchmarks/results/*.txt``: a first line naming the commit, ``main at
  <sha>``, and the run's JSON), and the commits of all the runs have the same ``kvdi/`` and the same switch
  connector (``git diff``: anything else, the benchmark's reporting included, may differ), the same workload and
  setup (:data:`WORKLOAD`, :data:`SETUP_FLAGS`), and no other file holds the same run (its start time);
- its passes carry the stall rule's counts (round six on): earlier runs kept vLLM's stalled passes, which move a
  round's ratio by as much as the bars.

Per configuration and pass: each run's geometric mean and rounds, the geometric mean [90 % t interval] of every round
pooled, and the one over servers (each server's geometric mean of its rounds one sample,
:func:`.bench_serve_stats.server_interval`), on which the ITL bar's verdict rests (:func:`.bench_serve_pooled.judge`):
two servers of the same code can differ in the ratio itself (``docs/bench-serve-power.md``, rounds eleven and
twelve), which rounds on one server do not average away, so an interval over pooled rounds can be too narrow; a run
of ``--servers K`` holds K servers, an earlier run one. Below them, with two runs or more, the interval over runs
(each run's geometric mean of its servers' means, unjudged: a run is a window of the host's time, and two windows
with the same prompts differed beyond their servers, round twelve), and how much a round spreads in its server and
from server to server (:func:`.bench_serve_stats.server_spread`). The multi-turn rounds alike against 1.0x. A file that
cannot be pooled is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.vllm.bench_serve import PASSES
from benchmarks.vllm.bench_serve_pooled import bar, interval_cell, judge
from benchmarks.vllm.bench_serve_stats import (
    geometric_mean,
    repeat_interval,
    run_document,
    server_interval,
    server_spread,
)
from benchmarks.vllm.bench_serve_switch import MT_FIGURES, hook_extra_us

ITL = ("server ITL p50", "server ITL p90")
CODE = ("kvdi", "benchmarks/vllm/switch_connector.py")
"""What a pooled run must share: kvdi itself and the connector that switches it."""
_COMMIT = re.compile(r"\bmain at ([0-9a-f]{7,40})\b")


class PoolError(ValueError):
    """A run that cannot be pooled (the message names the file and why)."""


def load_run(path: Path) -> tuple[str, dict[str, Any]]:
    """The commit a results file names on its first line and its run document."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PoolError(f"{path}: cannot be read ({exc})") from None
    found = _COMMIT.search(lines[0]) if lines else None
    if found is None:
        raise PoolError(f"{path}: its first line names no 'main at <sha>': cannot tell which code it measured")
    try:
        doc = run_document(lines)
        if doc is None:
            raise PoolError(f"{path}: holds no bench_serve_switch run document")
        for result in doc["results"]:
            for r in result.get("rounds", []):
                if any("stalls" not in r[mode][phase] for mode in r for phase in r[mode]):
                    raise PoolError(f"{path}: its passes carry no stall counts (a run before the stall rule)")
    except PoolError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise PoolError(f"{path}: its run document is not one bench_serve_switch writes ({exc!r:.120})") from None
    return found.group(1), doc


def check_distinct(paths: Sequence[Path], docs: Sequence[dict[str, Any]]) -> None:
    """PoolError when two files hold the same run (its rounds would count twice)."""
    seen: dict[str, Path] = {}
    for path, doc in zip(paths, docs, strict=True):
        started = str(doc.get("started"))
        if started in seen:
            raise PoolError(f"{path} and {seen[started]} hold the same run (started {started}): pool it once")
        seen[started] = path


SETUP_FLAGS = (
    ("stats_dir", True, "ran with kvdi's stats files on", "without", "--stats-dir"),
    ("engine_on_worker", False, "ran the engine core on the worker's cores", "beside the API server",
     "--engine-on-worker"),
)  # fmt: skip
"""What makes two runs different setups: ``(args key, its value in runs from before the flag, what a run with it
on did, what one with it off did, the flag)``. kvdi's stats files (every run before ``--stats-dir`` had them) cost
their writer threads' CPU; the engine core beside the API server and the client, or on the worker's cores (no run
before ``--engine-on-worker`` was), decides whose core its spinning wait takes."""


def recorded(doc: dict[str, Any], key: str, missing: object) -> str:
    """The run's argument ``key`` as its ``args`` recorded it (``missing`` where they did not)."""
    return str(doc.get("args", {}).get(key, missing))


def setup_flag(doc: dict[str, Any], key: str, before: bool) -> bool:
    """Whether a run had the setup flag ``key`` on (``before`` for runs from before the flag existed)."""
    return recorded(doc, key, before) == "True"


WORKLOAD = (
    ("prompts", "not recorded"), ("output_len", "not recorded"), ("settle_s", "not recorded"),
    ("reserved_cpus", "not recorded"), ("pin", "not recorded"), ("slices", 1),
)  # fmt: skip
"""The run's arguments that set what a pass runs and where (``args``, as the run recorded them), each with its value
in runs from before it was recorded: a round of 64 prompts, of servers not pinned, or of sliced passes
(:mod:`.bench_serve_slices`; runs from before ``--slices`` were unsliced, 1) is another measurement, so runs pool
only when every one of these is the same."""


def check_same_setup(paths: Sequence[Path], docs: Sequence[dict[str, Any]]) -> None:
    """PoolError when the runs differ in any of :data:`SETUP_FLAGS` or :data:`WORKLOAD`."""
    for key, before, with_it, without_it, flag in SETUP_FLAGS:
        on = [setup_flag(doc, key, before) for doc in docs]
        if len(set(on)) > 1:
            raise PoolError(f"{paths[on.index(True)]} {with_it}, {paths[on.index(False)]} {without_it} ({flag}): "
                            "not the same setup")  # fmt: skip
    for key, missing in WORKLOAD:
        values = [recorded(doc, key, missing) for doc in docs]
        other = next((i for i, value in enumerate(values) if value != values[0]), None)
        if other is not None:
            raise PoolError(f"{paths[0]} ran with {key} {values[0]}, {paths[other]} with {key} {values[other]}: "
                            "not the same workload")  # fmt: skip


def check_same_code(commits: Sequence[str], repo: Path) -> None:
    """PoolError unless every commit has the first one's :data:`CODE` (or git cannot compare them)."""
    for commit in dict.fromkeys(commits[1:]):
        cmd = ["git", "-C", str(repo), "diff", "--quiet", commits[0], commit, "--", *CODE]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PoolError(f"git cannot compare {commits[0]} and {commit} in {repo}: {exc}") from None
        if done.returncode == 1:
            raise PoolError(f"commits {commits[0]} and {commit} differ in {' or '.join(CODE)}: not the same code")
        if done.returncode != 0:
            raise PoolError(f"git cannot compare {commits[0]} and {commit} in {repo}: {done.stderr.strip()[:200]}")


def pooled(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """The table: per configuration and pass (then multi-turn), each run's ratios, every round pooled, and the
    interval over servers that the verdict rests on (:func:`.bench_serve_stats.server_interval`)."""
    single: dict[tuple[str, str], list[tuple[str, list[list[dict[str, Any]]]]]] = {}
    multi: dict[str, list[tuple[str, list[list[dict[str, Any]]]]]] = {}
    for name, doc in runs:
        servers: dict[str, list[list[dict[str, Any]]]] = {}
        for result in doc["results"]:
            if "multi_turn_rounds" in result:
                multi.setdefault(result["config"], []).append((name, [result["multi_turn_rounds"]]))
            else:
                servers.setdefault(result["config"], []).append(result["rounds"])
        for config, rounds in servers.items():
            for phase in PASSES:
                single.setdefault((config, phase), []).append((name, rounds))
    lines = ["bench_serve_switch rounds pooled over runs of the same code; kvdi / noop within a round, geometric "
             "mean [90% t interval]; the verdict on the interval over servers (each server's geometric mean one "
             "sample: a server's own offset is not averaged away by its rounds)"]  # fmt: skip
    for (config, phase), parts in single.items():
        per_run = [(name, [[{f: r["kvdi"][phase][f] / r["noop"][phase][f] for f in ITL} for r in rounds]
                           for rounds in servers]) for name, servers in parts]  # fmt: skip
        lines += _rows(f"{config} {phase}", ITL, per_run, bar(config, phase))
    lines += _hook_rows(runs)
    for config, parts in multi.items():
        per_run = [(name, [[{f: r["kvdi"][f] / r["noop"][f] for f in MT_FIGURES} for r in rounds]
                           for rounds in servers]) for name, servers in parts]  # fmt: skip
        lines += _rows(f"multi-turn {config}", MT_FIGURES, per_run, 1.0)
    return "\n".join(lines)


Ratios = dict[str, float]


def _rows(title: str, figures: Sequence[str], per_run: list[tuple[str, list[list[Ratios]]]],
          limit: float | None) -> list[str]:  # fmt: skip
    """A heading, one row per run, every round pooled, and the row over servers with its verdict against
    ``limit``."""
    servers = [rounds for _, runs in per_run for rounds in runs]
    every = {f: [ratios[f] for rounds in servers for ratios in rounds] for f in figures}
    lines = ["", f"{title:52s}" + "".join(f"{f:>26s}" for f in figures)]
    for name, runs in per_run:
        label = name if len(runs) == 1 else f"{name} ({len(runs)} servers)"
        lines.append(_row(label, {f: [ratios[f] for rounds in runs for ratios in rounds] for f in figures}))
    lines.append(_row("rounds pooled", every))
    over = {f: server_interval([[ratios[f] for ratios in rounds] for rounds in servers]) for f in figures}
    cells = "".join(f"{interval_cell(x) if x else '-':>26s}" for x in over.values())
    verdict = "" if limit is None else "  " + judge(list(over.values()), limit)
    lines.append(f"  {'over servers':40s} {len(servers):2d} servers" + cells + verdict)
    if len(per_run) > 1:  # a run is a window of the host's time: runs can differ beyond their servers
        means = {
            f: [[geometric_mean([r[f] for r in rounds]) for rounds in runs] for _, runs in per_run] for f in figures
        }
        cells = "".join(f"{interval_cell(x) if x else '-':>26s}" for x in (server_interval(v) for v in means.values()))
        lines.append(f"  {'over runs (unjudged)':40s} {len(per_run):2d} runs   " + cells)
    spreads = {f: server_spread([[ratios[f] for ratios in rounds] for rounds in servers]) for f in figures}
    if all(spreads.values()):
        cells = "".join(f"{f'{x[0]:.1%} / {x[1]:.1%}':>26s}" for x in spreads.values() if x)
        lines.append(f"  {'SD: a round in its server / server':52s}" + cells)
    return lines


def _hook_rows(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Per configuration and run: the µs a step that kvdi's hooks take over the do-nothing connector's (scheduler
    plus worker: both are on a step's path), and their share of the do-nothing connector's mean ITL: the cost
    that the ratios above measure with their noise, accounted for directly. A run of several servers: the median
    over its servers, with their range."""
    lines = ["", "time inside the switched hooks, kvdi - noop, scheduler + worker, per engine step, and its share of "
             "noop's server ITL mean (median over rounds and passes)"]  # fmt: skip
    for name, doc in runs:
        timed: dict[str, list[tuple[float, float]]] = {}
        for result in doc["results"]:
            extra, rounds = hook_extra_us(result), result.get("rounds")
            if extra is None or not rounds:
                continue
            step_ms = statistics.median(r["noop"][p]["server ITL mean"] for r in rounds for p in r["noop"])
            timed.setdefault(result["config"], []).append((extra, step_ms))
        for config, servers in timed.items():
            extra = statistics.median(x for x, _ in servers)
            step_ms = statistics.median(ms for _, ms in servers)
            share = extra / 10 / step_ms  # µs / (ms * 1000) * 100
            label = f"{config} {name}"
            line = f"  {label:52s} {extra:+7.1f} µs a step = {share:5.2f} % of a {step_ms:.2f} ms step"
            if len(servers) > 1:
                low, high = min(x for x, _ in servers), max(x for x, _ in servers)
                line += f" (median of {len(servers)} servers, {low:+.1f} to {high:+.1f} µs)"
            lines.append(line)
    return lines


def _row(label: str, ratios: dict[str, list[float]]) -> str:
    count = len(next(iter(ratios.values())))
    cells = []
    for values in ratios.values():
        interval = repeat_interval(values)
        cells.append(interval_cell(interval) if interval else f"{values[0]:.3f}")
    return f"  {label[:40]:40s} {count:3d} rounds" + "".join(f"{c:>26s}" for c in cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="bench_serve_switch results files (.txt)")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2], help="git repository")
    args = parser.parse_args(argv)
    try:
        loaded = [load_run(path) for path in args.runs]
        check_distinct(args.runs, [doc for _, doc in loaded])
        check_same_setup(args.runs, [doc for _, doc in loaded])
        check_same_code([commit for commit, _ in loaded], args.repo)
    except PoolError as exc:
        print(f"switch_pool: {exc}", file=sys.stderr)
        return 2
    names = [path.stem.removeprefix("bench_serve_switch-") for path in args.runs]
    print(pooled([(name, doc) for name, (_, doc) in zip(names, loaded, strict=True)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
