"""The pooled table of :mod:`.bench_serve`: every configuration against the do-nothing connector with the samples of
all repeats together, each ratio with its bootstrap interval, a verdict against issue 31's bars, and the server's
CPU time per generated token (see :mod:`.bench_serve_stats` for why each).

Bars (issue 31): kvdi ``null`` ITL p50 and p90 <= 1.03x ``noop`` on every pass; the store connectors <= 1.05x on
the ``hit`` pass and <= 1.15x on the ``load`` pass (no bar on ``cold``, where they store).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.vllm.bench_serve_stats import (
    histogram_quantiles,
    histogram_sum,
    pooled_quantiles,
    ratio_interval,
    repeat_interval,
    verdict,
)

BASELINE = "noop"
STORES = ("shared_storage", "cpu_offload", "redis")


def bar(config: str, phase: str) -> float | None:
    """Issue 31's ITL bar of ``config`` on ``phase`` (as a ratio to ``noop``), None where it sets none."""
    name = config.removesuffix("@before")
    if name == "null":
        return 1.03
    if name in STORES:
        return {"hit": 1.05, "load": 1.15}.get(phase)
    return None


def samples(doc: dict[str, Any], key: str, phase: str, config: str, figure: str) -> list[list[float]]:
    """Every request's samples of ``figure`` (``itl_ms``: its per-token ITLs; ``tpot_ms``: its TPOT alone) for
    ``config`` on this row and pass, all repeats together."""
    out: list[list[float]] = []
    for r in doc["results"]:
        fig = r.get("rows", {}).get(key, {}).get(phase, {})
        if r["config"] == config and figure in fig:
            out += fig[figure] if figure == "itl_ms" else [[x] for x in fig[figure]]
    return out


def engine_cpu_s(cpu: dict[str, float]) -> float:
    """The CPU seconds of vLLM's engine core and worker processes (``VLLM::EngineCor``, ``VLLM::Worker``: where
    kvdi's connector runs), the API server left out; the whole group where they are not named."""
    named = [v for k, v in cpu.items() if k.startswith("VLLM::")]
    return sum(named) if named else cpu["total"]


def cpu_ratios(doc: dict[str, Any], key: str, phase: str, config: str) -> list[float]:
    """``config``'s engine CPU seconds per generated token over ``noop``'s, one per repeat where both ran."""
    per: dict[int, dict[str, float]] = {}
    for r in doc["results"]:
        fig = r.get("rows", {}).get(key, {}).get(phase, {})
        if "cpu_s" in fig and fig.get("total_output_tokens"):
            per.setdefault(r["repeat"], {})[r["config"]] = engine_cpu_s(fig["cpu_s"]) / fig["total_output_tokens"]
    return [runs[config] / runs[BASELINE] for runs in per.values() if config in runs and runs.get(BASELINE)]


def interval_cell(value: tuple[float, float, float]) -> str:
    return f"{value[0]:.3f} [{value[1]:.3f}-{value[2]:.3f}]"


def spread_cell(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


MAX_BURSTS = 0.1  # over this share of coalesced chunk gaps the client-side ITL and TPOT are not judged


def burst_share(doc: dict[str, Any], key: str, phase: str, config: str) -> float:
    """The largest share of coalesced chunk gaps over ``config``'s passes of this row and pass."""
    values = [
        r["rows"][key][phase]["burst_fraction"]
        for r in doc["results"]
        if r["config"] == config and "burst_fraction" in r.get("rows", {}).get(key, {}).get(phase, {})
    ]
    return max(values, default=0.0)


def bursts(doc: dict[str, Any], key: str, phase: str, config: str) -> str:
    return f"{burst_share(doc, key, phase, config):.0%}"


COLUMNS = ("ITL p50", "ITL p90", "TPOT p50", "TPOT p90", "CPU/token", "bursts", "ITL bar")
SERVER_COLUMNS = ("server ITL p50", "server ITL p90", "server ITL mean", "server ITL bar")


def server_itl(doc: dict[str, Any], key: str, phase: str) -> dict[int, dict[str, list[float]]]:
    """Per repeat and configuration: vLLM's engine-side ITL p50, p90 and mean (ms) of this row and pass."""
    out: dict[int, dict[str, list[float]]] = {}
    for r in doc["results"]:
        hist = r.get("rows", {}).get(key, {}).get(phase, {}).get("server_itl_hist")
        if hist and hist.get("count"):
            mean = hist["sum"] / hist["count"] * 1e3
            out.setdefault(r["repeat"], {})[r["config"]] = [*histogram_quantiles(hist), mean]
    return out


def server_table(doc: dict[str, Any], key: str, phase: str, configs: list[str]) -> list[str]:
    """vLLM's own inter-token histogram (engine-side timestamps): each configuration's p50, p90 and mean over
    ``noop``'s, paired by repeat: geometric mean [90% t interval over repeats], and the verdict against its bar."""
    per = server_itl(doc, key, phase)
    base = [runs[BASELINE] for runs in per.values() if BASELINE in runs]
    if not base:
        return []
    lines = [f"{'  (server side)':28s}" + "".join(f"{c:>24s}" for c in SERVER_COLUMNS)]
    pooled = histogram_sum([
        r["rows"][key][phase]["server_itl_hist"] for r in doc["results"]
        if r["config"] == BASELINE and "server_itl_hist" in r.get("rows", {}).get(key, {}).get(phase, {})
    ])  # fmt: skip
    absolute = [f"{x:.3f} ms" for x in histogram_quantiles(pooled)]
    absolute.append(f"{statistics.median(b[2] for b in base):.3f} ms")
    lines.append(f"{'  noop (absolute)':28s}" + "".join(f"{c:>24s}" for c in absolute))
    for config in configs:
        if config == BASELINE:
            continue
        ratios = [[o / b for o, b in zip(runs[config], runs[BASELINE], strict=True)]
                  for runs in per.values() if config in runs and BASELINE in runs]  # fmt: skip
        if not ratios:
            continue
        intervals = [repeat_interval([r[i] for r in ratios]) for i in range(3)]
        cells = [interval_cell(x) if x else f"{ratios[0][i]:.3f}" for i, x in enumerate(intervals)]
        limit = bar(config, phase)
        cells.append("-" if limit is None else judge(intervals[:2], limit))
        lines.append(f"{'  ' + config:28s}" + "".join(f"{c:>24s}" for c in cells))
    return lines


def judge(intervals: list[tuple[float, float, float] | None], limit: float) -> str:
    """The worst verdict of the intervals against ``limit`` (a missing interval: one repeat, undecided)."""
    verdicts = {verdict(x, limit) if x else "undecided" for x in intervals}
    worst = "FAIL" if "FAIL" in verdicts else "undecided" if "undecided" in verdicts else "pass"
    return f"{worst} (<= {limit})"


def pooled_table(doc: dict[str, Any], boots: int = 300) -> list[str]:
    """Per (row, pass): each configuration's pooled ITL and TPOT quantile ratios to ``noop`` with their 90%
    bootstrap interval, its CPU/token ratio (median [min-max] of the repeats), the largest share of coalesced chunk
    gaps of its passes, and the verdict against its bar (both ITL quantiles must pass)."""
    configs = list(dict.fromkeys(r["config"] for r in doc["results"] if "rows" in r))
    keys = list(dict.fromkeys(k for r in doc["results"] for k in r.get("rows", {})))
    if BASELINE not in configs:
        return []
    lines = [
        "",
        "POOLED: all repeats' requests together; ratio to noop [90% bootstrap interval over requests]; CPU/token: the"
        " engine core's and worker's user+system CPU per generated token, median [min-max] of per-repeat ratios;"
        " bursts:"
        " the largest share of chunk gaps under 0.2 ms (coalesced, spread by deburst); ITL bar: pass / FAIL /"
        " undecided (the interval straddles the bar: more repeats), n/a where over 10% of either side's gaps were"
        " coalesced (whole requests read at once: the client's ITL and TPOT say nothing). (server side): vLLM's own"
        " inter-token histogram (engine-side output timestamps, --custom-histogram-buckets), ratios paired by"
        " repeat: geometric mean [90% t interval over repeats]; the decisive ITL figure where bursts are high",
    ]
    for key in keys:
        for phase in ("cold", "hit", "load"):
            base_itl = samples(doc, key, phase, BASELINE, "itl_ms")
            if not base_itl:
                continue
            base_tpot = samples(doc, key, phase, BASELINE, "tpot_ms")
            lines += ["", f"{key + ' ' + phase:28s}" + "".join(f"{c:>24s}" for c in COLUMNS)]
            base_cpu = [
                engine_cpu_s(r["rows"][key][phase]["cpu_s"]) / r["rows"][key][phase]["total_output_tokens"] * 1e3
                for r in doc["results"]
                if r["config"] == BASELINE and "cpu_s" in r.get("rows", {}).get(key, {}).get(phase, {})
            ]
            base = [f"{q:.3f} ms" for q in pooled_quantiles(base_itl) + pooled_quantiles(base_tpot)]
            base += [f"{statistics.median(base_cpu):.3f} ms" if base_cpu else "-", bursts(doc, key, phase, BASELINE)]
            lines.append(f"{'  noop (absolute)':28s}" + "".join(f"{c:>24s}" for c in base))
            for config in configs:
                itl = samples(doc, key, phase, config, "itl_ms")
                if config == BASELINE or not itl:
                    continue
                itl_r = ratio_interval(base_itl, itl, boots=boots)
                tpot_r = ratio_interval(base_tpot, samples(doc, key, phase, config, "tpot_ms"), boots=boots)
                limit = bar(config, phase)
                coalesced = max(burst_share(doc, key, phase, c) for c in (BASELINE, config)) > MAX_BURSTS
                judged = "-" if limit is None else "n/a (bursts)" if coalesced else judge(list(itl_r), limit)
                # coalesced chunks: a whole request read at once, its ITL and TPOT ~0; their ratios mean nothing
                cells = ["(bursts)" if coalesced else interval_cell(x) for x in itl_r + tpot_r]
                cells += [spread_cell(cpu_ratios(doc, key, phase, config)), bursts(doc, key, phase, config), judged]
                lines.append(f"{'  ' + config:28s}" + "".join(f"{c:>24s}" for c in cells))
            lines += server_table(doc, key, phase, configs)
    return lines
