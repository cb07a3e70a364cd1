"""Benchmark: kvdi against the do-nothing connector inside ONE ``vllm serve``, alternated pass by pass.

Usage (the vLLM venv, from the repository root)::

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_serve_switch [--configs null] [--rounds 8]

Why: two ``vllm serve`` processes with the same connector differ by 5-10 % in inter-token latency on this 2-core
machine (``docs/bench-serve-power.md``), so :mod:`.bench_serve`, one server per configuration, cannot decide issue
31's 3 % and 5 % bars. Here each kvdi configuration runs in one server behind
:class:`.switch_connector.SwitchConnector`, whose hooks answer either as kvdi or as the do-nothing connector; the
mode flips between passes while the server is idle. Each round runs, for each mode (``noop`` then ``kvdi``, the
order swapped every round: ABBA), the passes of :mod:`.bench_serve` on the same prompts (vLLM's ``bench serve``
client, ``prefix_repetition``, vLLM's prefix cache reset before each mode's ``cold`` pass): ``cold`` (kvdi
stores), ``hit`` (vLLM's cache holds every prefix) and ``load`` (vLLM's cache reset: kvdi loads, noop recomputes).
Every pass reads vLLM's engine-side inter-token histogram (``/metrics``) before and after. The ratio kvdi / noop of
each figure is taken within a round (same server, same prompts, seconds apart); the table gives their geometric
mean over rounds with its 90 % t interval, and each bar's verdict (``pass`` when the interval's top is at most the
bar, ``FAIL`` when its bottom is above it, else ``undecided``). ``--multi-turn N`` adds rounds of vLLM's multi-turn
client (:mod:`.bench_serve_multi_turn`); its bar is judged with ``--pin --engine-on-worker``
(:mod:`.bench_serve_pin`: vLLM's engine core waits for the worker spinning, so it shares the worker's core and
leaves the other to the API server and the client), the single-turn bars with ``--pin`` alone
(``docs/bench-serve-power.md``, round nine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.vllm import bench_serve as serve
from benchmarks.vllm.bench_serve_pooled import bar, interval_cell, judge
from benchmarks.vllm.bench_serve_slices import FIGURES, Measured, merge, plan, slice_seed
from benchmarks.vllm.bench_serve_slices import figures as pass_figures
from benchmarks.vllm.bench_serve_stats import (
    counter_totals,
    histogram_delta,
    itl_histogram,
    repeat_interval,
    server_interval,
)
from benchmarks.vllm.host_steal import cpu_jiffies, steal_pct, wait_quiet
from benchmarks.vllm.vllm_cli import patch_version
from tests.real_vllm.serve_support import model_with_tokenizer
from tests.real_vllm.vllm_support import make_tiny_llama

CONFIGS = serve.KVDI_CONFIGS
MODES = ("noop", "kvdi")
"""The switch's modes (:mod:`.switch_connector`, which imports vLLM: this module does not)."""
SWITCH = {"kv_connector": "SwitchConnector", "kv_connector_module_path": "benchmarks.vllm.switch_connector"}


def reports(folder: Path) -> dict[int, dict[str, Any]]:
    """Each switch connector's last report (pid, mode, hook times), by pid."""
    return {int(path.name): json.loads(path.read_text()) for path in folder.glob("[0-9]*")}


def acks(folder: Path) -> dict[int, str]:
    """Each switch connector's process and its mode, as it last wrote them."""
    return {pid: report["mode"] for pid, report in reports(folder).items()}


STEP_HOOKS = ("build_connector_meta", "bind_connector_metadata")
"""The hook vLLM calls once a step in each role (scheduler, worker): the steps a report's times are over."""


def _less(now: list[int], was: list[int]) -> list[int]:
    return [a - b for a, b in zip(now, was, strict=True)]


def since(report: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """A switch connector's report less what an earlier report of it counted (``before``; None: nothing), so that
    the figures cover only what ran between the two: its hook times and its garbage collections, per mode."""
    if before is None:
        return report
    was = before["times"]
    times = {mode: {hook: _less(kept, was.get(mode, {}).get(hook, [0, 0])) for hook, kept in hooks.items()}
             for mode, hooks in report["times"].items()}  # fmt: skip
    out = report | {"times": times}
    if "gc" in report:
        out["gc"] = {mode: _less(kept, before.get("gc", {}).get(mode, [0] * 4)) for mode, kept in report["gc"].items()}
    return out


def hook_times(folder: Path, start: dict[int, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Per mode: each role's steps, its hooks' time per step (µs) and the three costliest hooks (µs a step); with
    the process's garbage collections in that mode where the connector counted them: their time (µs a step,
    ``gc_us_per_step``) and how many of each generation ran a thousand steps (``gc_per_kstep``). With ``start``
    (:func:`counted_now`'s reports), only what ran since then."""
    out: dict[str, dict[str, Any]] = {}
    for pid, report in reports(folder).items():
        report = since(report, (start or {}).get(pid))
        for mode, hooks in report["times"].items():
            role = next((h for h in STEP_HOOKS if h in hooks), None)
            if role is None:
                continue
            steps = hooks[role][0]
            if steps <= 0:
                continue
            per = {name: ns / steps / 1e3 for name, (_, ns) in hooks.items()}
            top = sorted(per.items(), key=lambda kv: -kv[1])[:3]
            name = "scheduler" if role == STEP_HOOKS[0] else "worker"
            times: dict[str, Any] = {"steps": steps, "us_per_step": sum(per.values()), "top": top}
            collected = report.get("gc", {}).get(mode)
            if collected:
                times["gc_us_per_step"] = collected[3] / steps / 1e3
                times["gc_per_kstep"] = [n * 1e3 / steps for n in collected[:3]]
            out.setdefault(mode, {})[name] = times
    return out


def counted_now(folder: Path) -> dict[int, dict[str, Any]]:
    """Every switch connector's report as of now, by pid: a connector reports only when it flips, so the idle
    server's connectors are flipped twice (to the other mode and back)."""
    now = next(iter(acks(folder).values()))
    switch_to(MODES[1 - MODES.index(now)], folder)
    switch_to(now, folder)
    return reports(folder)


def final_hook_times(folder: Path, start: dict[int, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """:func:`hook_times` of every pass since ``start`` (:func:`counted_now` after the server's warm-up: its
    start-up's collections and warm-up's steps left out), the last round's last mode counted too."""
    counted_now(folder)
    return hook_times(folder, start)


def switch_to(mode: str, folder: Path, timeout_s: float = 30.0, settle_s: float = 0.0) -> None:
    """Flip every switch connector of the idle server to ``mode`` (SIGUSR1 to each process in the other one), after
    ``settle_s``: the last requests' queued saves finish, and their held blocks are freed, in the mode that began
    them."""
    time.sleep(settle_s)
    found = acks(folder)
    if len(found) != 2:
        raise RuntimeError(f"expected 2 switch connectors (engine core, worker), found {found}")
    for pid, now in found.items():
        if now != mode:
            os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while any(m != mode for m in acks(folder).values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"switch connectors did not all reach mode {mode}: {acks(folder)}")
        time.sleep(0.02)


def kvdi_counters(metrics_text: str) -> dict[str, float]:
    """kvdi's counters (``vllm:kvdi_*_total``) in a Prometheus page, summed over their label sets, by short name."""
    totals = counter_totals(metrics_text)
    return {family.removeprefix("vllm:kvdi_"): v for family, v in totals.items() if family.startswith("vllm:kvdi_")}


def thread_cpu_ms(pid: int) -> tuple[float, float]:
    """CPU time (user + system, ms) of ``pid``'s main thread and of all its other threads together, from
    ``/proc/<pid>/task/*/stat``; (0, 0) where /proc cannot say (another OS, a process gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    main = other = 0.0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                fields = task.joinpath("stat").read_text().rpartition(")")[2].split()
                ms = (int(fields[11]) + int(fields[12])) * 1e3 / tick  # utime, stime (fields 14, 15 of stat)
                if task.name == str(pid):
                    main += ms
                else:
                    other += ms
    return main, other


def process_cpu(folder: Path) -> dict[str, tuple[float, float]]:
    """:func:`thread_cpu_ms` of each switch connector's process, by role (``scheduler``: engine core; ``worker``)."""
    return {report.get("role") or str(pid): thread_cpu_ms(pid) for pid, report in reports(folder).items()}


def one_pass(server: serve.Server, argv: list[str], settle_s: float, folder: Path) -> Measured:
    """One client pass: the server's ITL quantiles and mean and the client's TTFT (ms), plus what kvdi counted
    (``kvdi <counter>``) and the CPU ms its processes spent (``cpu <role> main|threads``) during the pass; with the
    pass's histogram and TTFTs (:func:`.bench_serve_slices.merge` pools them), and the host's steal (%) while the
    client ran (:mod:`.host_steal`)."""
    time.sleep(settle_s)  # background saves of the previous pass done
    text = server.metrics_text()
    before, counted = itl_histogram(text), kvdi_counters(text)
    cpu = process_cpu(folder)
    host = cpu_jiffies()
    result = serve.run_client(argv)
    steal = steal_pct(host, cpu_jiffies())
    time.sleep(0.2)  # the API server records the last outputs' stats
    text = server.metrics_text()
    hist = histogram_delta(before, itl_histogram(text))
    errors = result.get("errors") or [""] * len(result["ttfts"])
    ttfts = [float(t) * 1e3 for t, error in zip(result["ttfts"], errors, strict=True) if not error]
    out = pass_figures(hist, ttfts) | {"completed": float(result["completed"])}
    out["client ITL p50"] = float(result["median_itl_ms"])
    out["steal %"] = steal
    moved = histogram_delta(counted, kvdi_counters(text))
    out |= {f"kvdi {k}": v for k, v in sorted(moved.items()) if v}
    return Measured(out | cpu_spent(cpu, process_cpu(folder)), hist, ttfts)


def cpu_spent(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """CPU ms each role's main thread and other threads spent between two :func:`process_cpu` readings."""
    out: dict[str, float] = {}
    for role, (main, threads) in after.items():
        was = before.get(role, (main, threads))
        out |= {f"cpu {role} main": main - was[0], f"cpu {role} threads": threads - was[1]}
    return out


STALL_ITL_MS = 0.5
"""A pass whose client-side median inter-token gap is below this (ms) was **stalled**: on this 2-core machine the
API server now and then falls behind mid-pass (after a hiccup of a few hundred ms) and from then on hands each
response to the client whole, at its end (TTFT ~1 s, every gap ~0 ms), with or without a connector
(``docs/bench-serve-power.md``, round six). The client then starts fewer requests at a time, so the engine-side
inter-token latency of that pass drops by ~10 %: a pass stalled in one mode only moves the round's ratio by as
much as the bars being judged."""
MAX_STALLS = 4
MAX_STOLEN = 4
"""How many times a pass that met more steal than ``--max-steal`` runs again (each time after
:func:`.host_steal.wait_quiet`)."""


LAST_STEAL: list[float | None] = [None]
"""The steal (%) the last pass met on this server; None before its first."""


def needs_probe(last_steal: float | None, max_steal: float) -> bool:
    """Whether a pass waits for a quiet host first (:func:`.host_steal.wait_quiet`): not right after a pass that
    met no more steal than the bound (its own reading was the probe; a burst begun since makes the pass run again,
    :func:`run_again`)."""
    return last_steal is None or last_steal > max_steal


def stalled(figures: dict[str, float]) -> bool:
    """Whether a pass's client saw whole responses delivered at once (:data:`STALL_ITL_MS`)."""
    return figures["client ITL p50"] < STALL_ITL_MS


def unstalled_pass(
    server: serve.Server, argv: list[str], args: argparse.Namespace, folder: Path, phase: str, name: str
) -> Measured:
    """:func:`one_pass` of ``phase`` (vLLM's prefix cache reset first for ``cold`` and ``load``), started on a quiet
    host (:func:`.host_steal.wait_quiet`: steal at most ``--max-steal``, waiting at most ``--steal-wait-s``; not
    after a quiet pass, :func:`needs_probe`), run
    again while it stalled (:func:`stalled`, at most :data:`MAX_STALLS` times) or met more steal than the bound (at
    most :data:`MAX_STOLEN` times); ``stalls`` and ``stolen`` count the passes run again, ``stalled`` and ``stolen
    kept`` whether the pass kept is still so. A store's ``cold`` pass is never run again (its store then holds the
    prompts: it would be another pass)."""
    stalls = stolen = 0
    while True:
        if phase in ("cold", "load") and not server.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused")
        if needs_probe(LAST_STEAL[0], args.max_steal):
            wait_quiet(args.max_steal, args.steal_wait_s)
        measured = one_pass(server, argv, args.settle_s, folder)
        figures = measured.figures
        LAST_STEAL[0] = figures["steal %"]
        again = run_again(figures, stalls, stolen, args.max_steal, phase, name)
        if again is None:
            measured.figures = figures | {
                "stalls": float(stalls), "stalled": float(stalled(figures)), "stolen": float(stolen),
                "stolen kept": float(figures["steal %"] > args.max_steal),
            }  # fmt: skip
            return measured
        if again == "stalled":
            stalls += 1
            print(f"  {name} {phase}: stalled (client ITL p50 {figures['client ITL p50']:.3f} ms, host steal "
                  f"{figures['steal %']:.1f} %), run again", file=sys.stderr)  # fmt: skip
        else:
            stolen += 1
            print(f"  {name} {phase}: host steal {figures['steal %']:.1f} % (bound {args.max_steal:g}), run again",
                  file=sys.stderr)  # fmt: skip


def run_again(
    figures: dict[str, float], stalls: int, stolen: int, max_steal: float, phase: str, name: str
) -> str | None:
    """Why a pass runs again: ``stalled`` (:func:`stalled`, fewer than :data:`MAX_STALLS` reruns so far), else
    ``stolen`` (more steal than ``max_steal`` %, fewer than :data:`MAX_STOLEN` reruns); None to keep it, and always
    for a store's ``cold`` pass (its store then holds the prompts: a rerun would be another pass)."""
    if phase == "cold" and name != "null":
        return None
    if stalled(figures) and stalls < MAX_STALLS:
        return "stalled"
    if figures.get("steal %", 0.0) > max_steal and stolen < MAX_STOLEN:
        return "stolen"
    return None


def serve_switched(name: str, args: argparse.Namespace, work: Path, redis_url: str, k: int = 0) -> dict[str, Any]:
    """Server ``k`` of kvdi ``name`` behind the switch (a fresh one for each of ``--servers``, with its own store):
    its ``--rounds`` rounds' passes in both modes, numbered on from the last server's (the first server's from
    ``--first-round``), so that the modes' order and the prompts go on changing from server to server and from
    run to run."""
    tag = name if k == 0 else f"{name}-{k}"
    store, stats, folder = work / f"store-{tag}", work / f"stats-{tag}", work / f"switch-{tag}"
    folder.mkdir()
    kv = serve.kv_for(name, store, redis_url, stats if args.stats_dir else None)
    assert kv is not None
    os.environ.update(BENCH_SWITCH_DIR=str(folder), BENCH_SWITCH_START="noop")
    LAST_STEAL[0] = None  # a new server's first pass probes the host
    server = serve.Server(args.model, work / f"serve-{tag}.log", {**kv, **SWITCH}, 2048, log_stats=True,
                          reserved_cpus=args.reserved_cpus)  # fmt: skip
    rounds: list[dict[str, dict[str, dict[str, float]]]] = []
    try:
        server.wait_ready()
        serve.run_client(serve.client_args("random", 4, 8, 10_000, args.model, server.url))  # warm-up
        start = counted_now(folder)
        for r in rounds_of(k, args.rounds, args.first_round):
            rounds.append((sliced_round if args.slices > 1 else whole_round)(server, args, folder, name, r))
        times = final_hook_times(folder, start)
    finally:
        server.stop()
    return {"config": name, "server": k, "rounds": rounds, "hook_times": times}


def rounds_of(k: int, rounds: int, first_round: int = 0) -> range:
    """The numbers of server ``k``'s rounds: ``rounds`` of them, numbered on from the server before it, the first
    server's from ``first_round`` (a round's number picks its prompts and which mode goes first)."""
    return range(first_round + k * rounds, first_round + (k + 1) * rounds)


def show(name: str, r: int, mode: str, phase: str, fig: dict[str, float], where: str = "") -> None:
    print(f"  {name} r{r}{where} {mode:4s} {phase:4s} " + " ".join(f"{k} {v:.3f}" for k, v in fig.items()),
          file=sys.stderr)  # fmt: skip


def whole_round(
    server: serve.Server, args: argparse.Namespace, folder: Path, name: str, r: int
) -> dict[str, dict[str, dict[str, float]]]:
    """One unsliced round: each mode's three passes on all the round's prompts, the modes in ABBA order."""
    argv = serve.client_args("prefix_repetition", 4, args.prompts, 1000 + r, args.model, server.url, args.output_len)
    row: dict[str, dict[str, dict[str, float]]] = {}
    for mode in MODES if r % 2 == 0 else MODES[::-1]:
        switch_to(mode, folder, settle_s=args.settle_s)
        row[mode] = {}
        for phase in serve.PASSES:
            row[mode][phase] = unstalled_pass(server, argv, args, folder, phase, name).figures
            show(name, r, mode, phase, row[mode][phase])
    return row


def sliced_round(
    server: serve.Server, args: argparse.Namespace, folder: Path, name: str, r: int
) -> dict[str, dict[str, dict[str, float]]]:
    """One sliced round (:mod:`.bench_serve_slices`): ``--slices`` slices of the round's prompts, each slice's
    passes in :func:`.bench_serve_slices.plan`'s order; each mode's figures of a phase merged over the slices."""
    each, now = args.prompts // args.slices, ""
    argvs = [serve.client_args("prefix_repetition", 4, each, slice_seed(r, i), args.model, server.url, args.output_len)
             for i in range(args.slices)]  # fmt: skip
    passes: dict[tuple[str, str], list[Measured]] = {}
    for i, mode, phase in plan(r, args.slices, MODES):
        if mode != now:
            switch_to(mode, folder, settle_s=args.settle_s)
            now = mode
        measured = unstalled_pass(server, argvs[i], args, folder, phase, name)
        passes.setdefault((mode, phase), []).append(measured)
        show(name, r, mode, phase, measured.figures, f".{i}")
    return {mode: {phase: merge(passes[mode, phase]) for phase in serve.PASSES} for mode in MODES}


MT_FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "run_s")


def serve_multi_turn_switched(name: str, args: argparse.Namespace, work: Path, redis_url: str) -> dict[str, Any]:
    """vLLM's multi-turn client (:mod:`.bench_serve_multi_turn`: 12 conversations x 10 turns, a cache of 48 blocks)
    against one server of kvdi ``name`` behind the switch: per round, the same conversations once in each mode
    (ABBA), vLLM's prefix cache reset before each run."""
    from benchmarks.vllm import bench_serve_multi_turn as mt

    client = mt.client_or_reason()
    if isinstance(client, str):
        raise RuntimeError(f"multi-turn: {client}")
    mt.add_chat_template(args.model)
    store, stats, folder = work / f"mt-store-{name}", work / f"mt-stats-{name}", work / f"mt-switch-{name}"
    folder.mkdir()
    kv = serve.kv_for(name, store, redis_url, stats if args.stats_dir else None)
    assert kv is not None
    os.environ.update(BENCH_SWITCH_DIR=str(folder), BENCH_SWITCH_START="noop")
    extra = ("--num-gpu-blocks-override", str(mt.CACHE_BLOCKS))
    server = serve.Server(args.model, work / f"mt-{name}.log", {**kv, **SWITCH}, 512, extra=extra, log_stats=True,
                          reserved_cpus=args.reserved_cpus)  # fmt: skip
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        server.wait_ready()
        start = counted_now(folder)
        for r in range(args.multi_turn):
            conv = mt.conversations(work / f"mt-conversations-{name}-{r}.json", seed=500 + r)
            row = {}
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                switch_to(mode, folder, settle_s=args.settle_s)
                if not server.reset_prefix_cache():
                    raise RuntimeError("reset_prefix_cache refused")
                time.sleep(args.settle_s)
                before, cpu = mt.server_snapshot(server.metrics_text()), process_cpu(folder)
                fig = mt.run_rounds(client, args.model, server.url, [conv], work / f"mt-{name}-{r}-{mode}")
                after = mt.server_snapshot(server.metrics_text())
                fig |= mt.server_work(before, after) | cpu_spent(cpu, process_cpu(folder))
                row[mode] = fig
                print(f"  multi-turn {name} r{r} {mode:4s} " + " ".join(f"{k} {v:.3f}" for k, v in fig.items()),
                      file=sys.stderr)  # fmt: skip
            rounds.append(row)
        switch_to("noop", folder)
        times = final_hook_times(folder, start)
    finally:
        server.stop()
    return {"config": name, "multi_turn_rounds": rounds, "hook_times": times}


def mt_table(result: dict[str, Any]) -> list[str]:
    """The multi-turn rounds of one configuration: kvdi / noop per round, geometric mean [90 % t interval], and the
    issue's bar (the whole run and TTFT p50 and p90 at most 1.0x the do-nothing connector)."""
    name, rounds = result["config"], result["multi_turn_rounds"]
    lines = ["", f"multi-turn {name} ({len(rounds)} rounds)" + "".join(f"{f:>24s}" for f in (*MT_FIGURES, "bar"))]
    noop = "".join(f"{statistics.median(r['noop'][f] for r in rounds):>24.3f}" for f in MT_FIGURES)
    lines.append(f"{'  noop (absolute, median)':28s}" + noop)
    intervals = [repeat_interval([r["kvdi"][f] / r["noop"][f] for r in rounds]) for f in MT_FIGURES]
    cells = [interval_cell(x) if x else "-" for x in intervals]
    cells.append(judge(list(intervals), 1.0))
    lines.append(f"{'  kvdi ' + name:28s}" + "".join(f"{c:>24s}" for c in cells))
    server = [k for k in SERVER_FIGURES if all(k in r[m] for r in rounds for m in MODES)]
    if server:  # vLLM's own figures, without the client processes' share: no bar on them
        ratios = [repeat_interval([r["kvdi"][k] / r["noop"][k] for r in rounds]) for k in server]
        lines.append(
            f"{'  server side, kvdi / noop':28s}"
            + "".join(
                f"{k.removesuffix('_ms')} {interval_cell(x) if x else '-'}  "
                for k, x in zip(server, ratios, strict=True)
            )
        )
    return lines + pass_work([{m: {"run": r[m]} for m in MODES} for r in rounds], "run")


SERVER_FIGURES = ("server_ttft_p50_ms", "server_ttft_p90_ms", "engine_request_ms")
"""vLLM's own figures of a multi-turn run (:func:`.bench_serve_multi_turn.server_work`), as ratios beside the bar's."""


WORK_KEYS = ("cpu ", "kvdi ", "vllm:", "engine_", "server_")


def pass_work(rounds: list[dict[str, Any]], phase: str) -> list[str]:
    """What each mode did in ``phase``, medians over rounds: CPU ms of the engine core's and the worker's main
    thread and other threads, (kvdi mode) kvdi's counters, and (multi-turn) vLLM's engine-side request times and
    counters (:func:`.bench_serve_multi_turn.server_work`): where time goes outside the hooks."""
    lines = []
    for mode in MODES:
        keys = sorted({k for r in rounds for k in r[mode][phase] if k.startswith(WORK_KEYS)})
        if keys:
            med = {k: statistics.median(r[mode][phase].get(k, 0.0) for r in rounds) for k in keys}
            cells = [f"{k[4:] if k.startswith('cpu ') else k} {v:.0f}" for k, v in med.items()]
            lines.append(f"    {mode:4s} per pass (median): " + ", ".join(cells))
    return lines


def table(doc: dict[str, Any]) -> str:
    """Per configuration and pass: each figure's kvdi / noop ratio within a round, geometric mean [90 % t interval]
    over rounds, and the ITL bar's verdict (on the p50 and p90 intervals); with ``--servers`` above one, the
    verdict rests on the interval over servers (:func:`.bench_serve_stats.server_interval`) instead."""
    lines = [
        f"vllm serve, kvdi behind the switch, {servers_said(doc)} per configuration; {doc['minutes']} min; ratios "
        "kvdi / noop within a round (same server, same prompts), geometric mean [90% t interval] over rounds",
    ]
    head = f"{'':28s}" + "".join(f"{f:>24s}" for f in (*FIGURES, "ITL bar"))
    servers: dict[str, list[dict[str, Any]]] = {}
    multi: list[str] = []
    for result in doc["results"]:
        if "multi_turn_rounds" in result:
            multi += mt_table(result) + hook_lines(result)
        else:
            servers.setdefault(result["config"], []).append(result)
    for name, results in servers.items():
        rounds = [r for result in results for r in result["rounds"]]
        for phase in serve.PASSES:
            many = f", {len(results)} servers" if len(results) > 1 else ""
            lines += ["", f"{name} {phase} ({len(rounds)} rounds{many})" + head[len(name) + len(phase) + 12 :]]
            noop = "".join(f"{statistics.median(r['noop'][phase][f] for r in rounds):>21.3f} ms" for f in FIGURES)
            lines.append(f"{'  noop (absolute, median)':28s}" + noop)
            ratios = {f: [r["kvdi"][phase][f] / r["noop"][phase][f] for r in rounds] for f in FIGURES}
            intervals = {f: repeat_interval(v) for f, v in ratios.items()}
            cells = [interval_cell(x) if x else f"{ratios[f][0]:.3f}" for f, x in intervals.items()]
            limit = bar(name, phase)
            by_server = {f: server_interval([[r["kvdi"][phase][f] / r["noop"][phase][f] for r in result["rounds"]]
                                             for result in results]) for f in FIGURES}  # fmt: skip
            judged = by_server if len(results) > 1 else intervals
            verdict = "-" if limit is None else judge([judged["server ITL p50"], judged["server ITL p90"]], limit)
            cells.append(verdict if len(results) == 1 else "over servers")
            lines.append(f"{'  kvdi ' + name:28s}" + "".join(f"{c:>24s}" for c in cells))
            if len(results) > 1:
                cells = [interval_cell(x) if x else "-" for x in by_server.values()] + [verdict]
                lines.append(f"{'  over servers':28s}" + "".join(f"{c:>24s}" for c in cells))
            lines += pass_work(rounds, phase)
            stalls = {m: sum(int(r[m][phase].get("stalls", 0)) for r in rounds) for m in MODES}
            left = {m: sum(int(r[m][phase].get("stalled", 0)) for r in rounds) for m in MODES}
            if any(stalls.values()) or any(left.values()):
                lines.append("    passes run again, stalled (client saw whole responses at once): "
                             + ", ".join(f"{m} {stalls[m]}" for m in MODES)
                             + "; kept stalled: " + ", ".join(f"{m} {left[m]}" for m in MODES))  # fmt: skip
            lines += steal_lines(rounds, phase)
        lines += hook_lines(results[0]) if len(results) == 1 else server_hook_lines(results)
    return "\n".join(lines + multi)


def steal_lines(rounds: list[dict[str, Any]], phase: str) -> list[str]:
    """The host's steal in ``phase`` (runs from before :mod:`.host_steal` recorded none: no line): each mode's median
    and most over rounds (a sliced round's figure is its worst slice), and the passes run again for it."""
    steal = {m: [r[m][phase]["steal %"] for r in rounds if "steal %" in r[m][phase]] for m in MODES}
    if not all(steal.values()):
        return []
    again = {m: sum(int(r[m][phase].get("stolen", 0)) for r in rounds) for m in MODES}
    kept = {m: sum(int(r[m][phase].get("stolen kept", 0)) for r in rounds) for m in MODES}
    cells = [f"{m} {statistics.median(v):.1f} (most {max(v):.1f})" for m, v in steal.items()]
    return ["    host steal %, median over rounds: " + ", ".join(cells) + "; passes run again for it: "
            + ", ".join(f"{m} {again[m]}" for m in MODES) + "; kept over the bound: "
            + ", ".join(f"{m} {kept[m]}" for m in MODES)]  # fmt: skip


def servers_said(doc: dict[str, Any]) -> str:
    """How many servers each configuration ran on (``--servers``; runs from before it: one)."""
    count = int(doc.get("args", {}).get("servers", 1))
    return "one server" if count == 1 else f"{count} fresh servers"


def hook_step_us(result: dict[str, Any], mode: str, figure: str = "us_per_step") -> float | None:
    """The µs a step inside ``mode``'s switched hooks (``figure`` ``gc_us_per_step``: in its garbage collections),
    scheduler and worker together; None where a role did not count it (collections: runs from before
    :data:`.switch_connector.GC`)."""
    roles = result["hook_times"][mode].values()
    if not roles or any(figure not in t for t in roles):
        return None
    return float(sum(t[figure] for t in roles))


def hook_extra_us(result: dict[str, Any], figure: str = "us_per_step") -> float | None:
    """The µs a step kvdi's switched hooks took over the do-nothing connector's (``figure``: as
    :func:`hook_step_us`), scheduler and worker together; None where the server did not time both modes."""
    if set(result.get("hook_times") or ()) != set(MODES):
        return None
    kvdi, noop = hook_step_us(result, "kvdi", figure), hook_step_us(result, "noop", figure)
    return None if kvdi is None or noop is None else kvdi - noop


def server_hook_lines(results: list[dict[str, Any]]) -> list[str]:
    """One line a server: the µs a step kvdi's hooks took over the do-nothing connector's; and one for the garbage
    collections, where they were counted."""
    lines = []
    for what, figure in (("time inside the switched hooks", "us_per_step"),
                         ("garbage collections' time", "gc_us_per_step")):  # fmt: skip
        extra = [x for x in (hook_extra_us(r, figure) for r in results) if x is not None]
        if extra:
            cells = ", ".join(f"{x:+.1f}" for x in extra)
            lines.append(f"{results[0]['config']}: {what}, kvdi - noop, µs a step (scheduler + worker), "
                         f"server by server: {cells}; median {statistics.median(extra):+.1f}")  # fmt: skip
    return lines


def hook_lines(result: dict[str, Any]) -> list[str]:
    """Time inside the switched hooks per engine step, and the engine steps each mode ran over the whole run."""
    if not result.get("hook_times"):
        return []
    lines = [f"{result['config']}: time inside the switched hooks per engine step, both modes timed alike (µs):"]
    for mode, roles in result["hook_times"].items():
        for role, t in roles.items():
            top = ", ".join(f"{h} {us:.1f}" for h, us in t["top"])
            lines.append(f"  {mode:4s} {role:9s} {t['us_per_step']:7.1f} over {t['steps']} steps ({top})")
            if "gc_us_per_step" in t:
                per = "/".join(f"{n:.1f}" for n in t["gc_per_kstep"])
                lines.append(f"  {mode:4s} {role:9s} {t['gc_us_per_step']:7.1f} in garbage collections "
                             f"(generations 0/1/2: {per} a thousand steps)")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="null", help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument("--rounds", type=int, default=8, help="rounds of both modes (even: ABBA balanced)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--slices", type=int, default=1, help="slices of a round, modes side by side (1: unsliced)")
    parser.add_argument("--servers", type=int, default=1, help="fresh servers per configuration, --rounds each")
    parser.add_argument(
        "--first-round", type=int, default=0, help="number of the first round (its prompts, its modes' order)"
    )
    parser.add_argument(
        "--max-steal", type=float, default=5.0, help="%% of host CPU time stolen by the hypervisor a pass may meet"
    )
    parser.add_argument(
        "--steal-wait-s", type=float, default=300.0, help="how long a pass waits for the host's steal to drop"
    )
    parser.add_argument("--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU (as bench_serve)")
    parser.add_argument("--pin", action="store_true", help="as bench_serve --pin")
    parser.add_argument(
        "--engine-on-worker", action="store_true", help="with --pin: the engine core on the worker's cores"
    )
    parser.add_argument("--multi-turn", type=int, default=0, help="rounds of vLLM's multi-turn client (0: none)")
    parser.add_argument("--mt-configs", default="shared_storage,cpu_offload", help="configurations it runs")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--stats-dir", action="store_true", help="kvdi's opt-in stats files on (kvdi_stats_dir; earlier runs had them)"
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="keep stores and server logs here (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    bad += [c for c in args.mt_configs.split(",") if c and c not in CONFIGS]
    one_round = args.rounds == 1 and args.slices > 1 and args.slices % 2 == 0  # each mode first in half the slices
    rounds_ok = args.rounds in (0, *range(2, 1000)) or one_round
    if bad or not rounds_ok or args.prompts < 4 or args.multi_turn == 1:
        print(f"--configs/--mt-configs {bad} / --rounds {args.rounds} / --prompts {args.prompts} / --multi-turn "
              f"{args.multi_turn}: allowed {CONFIGS}, 0 or >= 2 (1 with an even --slices), >= 4, "
              "0 or >= 2", file=sys.stderr)  # fmt: skip
        return 2
    if not 1 <= args.servers <= 64:
        print(f"--servers {args.servers}: allowed 1-64 fresh servers per configuration", file=sys.stderr)
        return 2
    if not 0 <= args.first_round <= 100_000:
        print(f"--first-round {args.first_round}: allowed 0-100000 (a later run's rounds numbered on from an earlier "
              "run's, so that its prompts are new)", file=sys.stderr)  # fmt: skip
        return 2
    if not 0 <= args.max_steal <= 100 or not 0 <= args.steal_wait_s <= 3600:
        print(f"--max-steal {args.max_steal:g} / --steal-wait-s {args.steal_wait_s:g}: allowed 0-100 % and 0-3600 s",
              file=sys.stderr)  # fmt: skip
        return 2
    if not 1 <= args.slices <= 16 or args.prompts % args.slices or args.prompts // args.slices < 4:
        print(f"--slices {args.slices}: allowed 1-16, dividing --prompts ({args.prompts}) into slices of at least 4 "
              "prompts", file=sys.stderr)  # fmt: skip
        return 2
    if args.engine_on_worker and not args.pin:
        print("--engine-on-worker: places the engine core of a pinned run; allowed only with --pin", file=sys.stderr)
        return 2
    if args.multi_turn:  # said before any server starts, not as a traceback after the single-turn rounds
        from benchmarks.vllm.bench_serve_multi_turn import client_or_reason

        client = client_or_reason()
        if isinstance(client, str):
            print(f"--multi-turn {args.multi_turn}: vLLM's multi-turn client cannot run: {client}", file=sys.stderr)
            return 2
    patch_version()
    priority = serve.client_priority()
    serve.SERVER_PRIORITY[0] = serve.CLIENT_PRIORITY  # as bench_serve's default --server-priority
    priority = priority.replace(f"servers at {serve.BASE_PRIORITY}", f"servers at {serve.CLIENT_PRIORITY}")
    serve.PIN[0] = args.pin
    serve.ENGINE_ON_WORKER[0] = args.engine_on_worker
    print(priority, file=sys.stderr)
    from kvdi.testing.redis_server import RedisServer

    started = time.time()
    results = []
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvdi-bench-switch-")))
        work.mkdir(parents=True, exist_ok=True)
        cache = serve.ROOT / ".bench" / "serve"
        cache.mkdir(parents=True, exist_ok=True)
        args.model = model_with_tokenizer(make_tiny_llama(cache / "llama"), cache / "model")
        redis = RedisServer().start()
        try:
            for name in configs if args.rounds else ():
                results += [serve_switched(name, args, work, redis.url, k) for k in range(args.servers)]
            for name in [c for c in args.mt_configs.split(",") if c] if args.multi_turn else ():
                results.append(serve_multi_turn_switched(name, args, work, redis.url))
        finally:
            redis.stop()
    return serve.publish("bench_serve_switch", started, priority, args, results, table)


if __name__ == "__main__":
    sys.exit(main())
