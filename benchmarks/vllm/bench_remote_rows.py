"""The remote tier's acceptance rows: time to first token loading from Redis 0, 1, 5, 50 ms away, 5 ms with heavy
jitter and a store that stalls mid-load, as a ratio to no connector (``bench_remote.py --rows``).

Usage (the vLLM venv, from the repository root)::

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_remote --rows [--repeats 2] [--out r.json]
    ... --rows --row 50 --configs none kvdi   # one row, two engines

Redis (a real ``redis-server`` on loopback) sits behind :class:`~kvdi.testing.latency_proxy.LatencyProxy`. Per
repeat, one engine per configuration (the order rotated per repeat): ``none`` (no connector), ``kvdi``
(``transfer.async_load=auto``, ``scheduler.lookup=auto``: Redis is ``--start-delay-ms`` away while the engine
starts, so ``auto`` prefetches at lookup and looks up in the background; ``scheduler.load_deadline`` on) and
``kvdi-nodeadline`` (the same, the rule off). Each engine computes every row's prompts once (``store``: kvdi
saves them to Redis, 0 ms away), then runs ``--rounds`` rounds of the rows, each row ``--prompts`` requests
arriving together with vLLM's prefix cache dropped first (``reset``: the hits come from Redis, or are recomputed).
Before each row the engine waits at a barrier while the proxy is set for it (and ``--settle-s`` passes, so kvdi's
background saves are done):

- ``0``, ``1``, ``5``, ``50``: that many ms each way;
- ``5j``: 5 ms with heavy jitter: every 2 ms the delay is redrawn, 1-9 ms uniformly, or 40 ms one time in ten;
- ``stall``: 1 ms, and ``--stall-after-ms`` after the row starts redis-server is stopped (SIGSTOP) for
  ``--stall-s`` seconds, while the row's lookups and loads are in flight.

Per row and round: the median and the 90th percentile of the requests' time to first token, each as a ratio to
``none``'s in the same repeat; the table shows the median ratio over repeats and rounds, [min-max]. kvdi's
scheduler counters (``deadline_recomputes``, ``lookups_skipped``, ``deadline_refused``) are read at each barrier,
so they are per row. Greedy tokens must be identical across every engine for the same prompt (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.vllm.bench_vllm import check_tokens, run_engine
from tests.real_vllm.vllm_support import IN_PROCESS, kv_config, make_prompts, make_tiny_llama, read_stats

ROWS = ("0", "1", "5", "50", "5j", "stall")
CONFIGS = ("none", "kvdi", "kvdi-nodeadline")
COUNTERS = ("deadline_recomputes", "lookups_skipped", "deadline_refused", "deadline_probes", "load_failures")
KEY_PREFIX = "bench-rows:"
Snaps = dict[str, dict[str, float]]


class Conditions:
    """What the proxy and the server do for a row: a delay, jitter (a thread redrawing it) or a stall."""

    def __init__(self, proxy: Any, server: Any, args: argparse.Namespace) -> None:
        self.proxy, self.server, self.args = proxy, server, args
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set(self, row: str) -> None:
        self.clear()
        self.proxy.delay_ms = 1.0 if row == "stall" else 5.0 if row == "5j" else float(row)
        if row in ("5j", "stall"):
            self._stop = threading.Event()
            target = self._jitter if row == "5j" else self._stall
            self._thread = threading.Thread(target=target, name=f"bench-{row}", daemon=True)

    def started(self) -> None:
        """The row's phase is about to start (the barrier lets go)."""
        if self._thread is not None:
            self._thread.start()

    def _jitter(self) -> None:
        rnd = random.Random(7)
        while not self._stop.wait(0.002):
            self.proxy.delay_ms = 40.0 if rnd.random() < 0.1 else rnd.uniform(1.0, 9.0)

    def _stall(self) -> None:
        if self._stop.wait(self.args.stall_after_ms / 1e3):
            return
        self.server.freeze()
        try:
            self._stop.wait(self.args.stall_s)
        finally:
            self.server.thaw()

    def clear(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(self.args.stall_s + 5)
        self._thread = None


def row_prompts(args: argparse.Namespace, r: int) -> dict[str, list[list[list[int]]]]:
    return {row: [make_prompts(args.prompts, args.tokens, seed=70_000 + 1000 * r + 10 * i + k)
                  for k in range(args.rounds)] for i, row in enumerate(ROWS) if row in args.row}  # fmt: skip


def phases(args: argparse.Namespace, prompts: dict[str, list[list[list[int]]]], barrier: Any) -> list[dict[str, Any]]:
    mt = args.max_tokens
    stored = [p for rounds in prompts.values() for ps in rounds for p in ps]
    out: list[dict[str, Any]] = [
        {
            "kind": "round",
            "name": "warmup",
            "prompts": make_prompts(args.prompts, args.tokens, seed=1),
            "max_tokens": mt,
        },
        {"kind": "round", "name": "store", "prompts": stored, "max_tokens": mt, "barrier": barrier("0", "store")},
    ]
    for k in range(args.rounds):
        for row in args.row:
            name = f"{row}#{k}"
            out.append({"kind": "round", "name": name, "prompts": prompts[row][k], "max_tokens": mt, "reset": True,
                        "barrier": barrier(row, name)})  # fmt: skip
    return out


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def bench_rows(args: argparse.Namespace, work: Path, server: Any, proxy: Any) -> dict[str, Any]:
    from benchmarks.vllm.bench_remote import Gate

    model = make_tiny_llama(work / "model", layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=4)
    n_stored = args.prompts * args.rounds * len(args.row)
    base = {
        "model": str(model),
        "prefix_caching": True,
        "block_size": args.block_size,
        "max_model_len": args.tokens + 64 + args.block_size,
        "max_num_batched_tokens": max(args.prompts * args.tokens, 2048) + args.block_size,
        "phase_timeout_s": args.phase_timeout,
    }
    gate, conditions = Gate(), Conditions(proxy, server, args)
    engines: dict[str, list[dict[str, Any]]] = {c: [] for c in args.configs}
    specs: dict[str, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    started = time.time()
    try:
        for r in range(args.repeats):
            prompts = row_prompts(args, r)
            order = args.configs[r % len(args.configs) :] + args.configs[: r % len(args.configs)]
            for config in order:
                name = f"rows-{config}-{r}"
                stats = work / f"stats-{name}"
                snaps: Snaps = {}

                def barrier(row: str, label: str, name: str = name, stats: Path = stats, snaps: Snaps = snaps) -> str:
                    def action() -> None:
                        conditions.set(row)
                        time.sleep(args.settle_s)
                        snaps[label] = read_stats(stats, "scheduler")
                        conditions.started()

                    return gate.expect(work / f"{name}-{label}", action)

                proxy.delay_ms = args.start_delay_ms  # what kvdi's auto measures at start (the store phase: 0 ms)
                spec: dict[str, Any] = {**base, "phases": phases(args, prompts, barrier)}
                if config != "none":
                    spec["kv"] = kv_config("redis", stats_dir=stats, redis__url=proxy.url("redis"),
                                           redis__key_prefix=KEY_PREFIX, scheduler__load_deadline=config == "kvdi",
                                           redis__op_timeout_s=max(30.0, args.stall_s + 10))  # fmt: skip
                specs[f"{config}#{r}"] = spec
                res = run_engine(work, name, spec, env=IN_PROCESS)
                conditions.clear()
                if "failed" in res:
                    failures.append({"engine": f"{config}#{r}", **res})
                    continue
                snaps["end"] = read_stats(stats, "scheduler") if config != "none" else {}
                engines[config].append(
                    {"repeat": r, "phases": {p["name"]: p for p in res["phases"]}, "counters": snaps}
                )
                print(f"[bench] repeat {r} {config}: done at {time.time() - started:.0f}s", file=sys.stderr)
    finally:
        conditions.clear()
        gate.close()
    mismatches = check_tokens(engines, specs)
    setup = {**vars(args), "work": str(work), "out": str(args.out), "stored_prompts": n_stored}
    setup.update(wall_s=time.time() - started, rows=args.row, load_average_1min=os.getloadavg()[0], cpus=os.cpu_count())
    doc = {"setup": setup, "failures": failures, "tokens_identical": mismatches == 0, "token_mismatches": mismatches}
    doc["rows"] = summarize(args, engines)
    return doc


def summarize(args: argparse.Namespace, engines: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per config and row: median and p90 TTFT ratios to ``none`` over repeats and rounds, and the row's counters."""
    base = {e["repeat"]: e for e in engines.get("none", [])}
    out: dict[str, Any] = {}
    for config, runs in engines.items():
        if config == "none":
            continue
        for row in args.row:
            medians, p90s, counts = [], [], dict.fromkeys(COUNTERS, 0.0)
            for e in runs:
                ref = base.get(e["repeat"])
                labels = [f"{row}#{k}" for k in range(args.rounds)]
                for label in labels:
                    mine, theirs = e["phases"][label]["ttft_s"], ref["phases"][label]["ttft_s"] if ref else None
                    if theirs:
                        medians.append(statistics.median(mine) / statistics.median(theirs))
                        p90s.append(p90(mine) / p90(theirs))
                    snaps = e["counters"]
                    names = list(snaps)
                    after = snaps[names[names.index(label) + 1]] if label in names else {}
                    for c in COUNTERS:
                        counts[c] += after.get(c, 0) - snaps.get(label, {}).get(c, 0)
            out[f"{config}|{row}"] = {"median_ratio": medians, "p90_ratio": p90s, "counters": counts}
    return out


def rows_table(doc: dict[str, Any]) -> str:
    def fig(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]" if values else "-"

    lines = ["| config | row | TTFT median / none | TTFT p90 / none | deadline recomputes | lookups skipped |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for key, row in doc["rows"].items():
        config, name = key.split("|")
        c = row["counters"]
        lines.append(f"| {config} | {name} | {fig(row['median_ratio'])} | {fig(row['p90_ratio'])} | "
                     f"{c['deadline_recomputes']:.0f} | {c['lookups_skipped']:.0f} |")  # fmt: skip
    lines.append(f"tokens identical: {doc['tokens_identical']}; goal: no row above 1.1x")
    return "\n".join(lines)


def add_rows_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", action="store_true", help="the acceptance rows (TTFT vs no connector) instead")
    p.add_argument("--row", nargs="+", choices=ROWS, default=list(ROWS), help="--rows: which rows (default all)")
    p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="--rows: engines")
    p.add_argument("--start-delay-ms", type=float, default=5.0, help="--rows: proxy delay while engines start")
    p.add_argument("--stall-s", type=float, default=2.0, help="--rows: how long redis-server is stopped")
    p.add_argument("--stall-after-ms", type=float, default=15.0, help="--rows: when in the row it stops")


__all__ = ["ROWS", "add_rows_args", "bench_rows", "rows_table"]
