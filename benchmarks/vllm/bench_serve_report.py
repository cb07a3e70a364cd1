"""The human table of :mod:`.bench_serve`: every configuration's latencies as ratios to the do-nothing connector.

A ratio pairs a configuration with the do-nothing connector (``noop``) of the same repeat; the table shows the
median of those ratios over the repeats and their range ``[min-max]``, the do-nothing connector's own figures in
ms, and the 1-minute load average seen at the passes (the machine may be shared).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.vllm.bench_serve_pooled import judge, pooled_table
from benchmarks.vllm.bench_serve_stats import repeat_interval

COLUMNS = (
    ("median_ttft_ms", "TTFT p50"),
    ("p90_ttft_ms", "TTFT p90"),
    ("median_itl_ms", "ITL p50"),
    ("p90_itl_ms", "ITL p90"),
    ("median_tpot_ms", "TPOT p50"),
    ("p90_tpot_ms", "TPOT p90"),
    ("duration", "run"),
)
BASELINE = "noop"
UNITS = {"duration": " s"}
# Below this the do-nothing connector's streams arrived coalesced (vLLM's API server sent a request's tokens
# together), and a ratio to it says nothing: such cells read "n/a".
MIN_BASELINE_MS = 0.5


def ratios(doc: dict[str, Any], key: str, phase: str, figure: str, config: str) -> list[float]:
    """``config``'s figure over the baseline's, one per repeat where both ran this row and pass (and the
    baseline's latency is above :data:`MIN_BASELINE_MS`)."""
    by_repeat: dict[int, dict[str, float]] = {}
    for result in doc["results"]:
        value = result.get("rows", {}).get(key, {}).get(phase, {}).get(figure)
        if value is not None:
            by_repeat.setdefault(result["repeat"], {})[result["config"]] = value
    floor = 0.0 if figure == "duration" else MIN_BASELINE_MS
    return [
        runs[config] / runs[BASELINE]
        for runs in by_repeat.values()
        if config in runs and runs.get(BASELINE, 0.0) > floor
    ]


def cell(values: list[float]) -> str:
    if not values:
        return "n/a"
    median = statistics.median(values)
    return f"{median:.2f} [{min(values):.2f}-{max(values):.2f}]" if len(values) > 1 else f"{median:.2f}"


def absolute(values: list[float], unit: str) -> str:
    return f"{statistics.median(values):.1f}{unit}" if values else "n/a"


def baseline_ms(doc: dict[str, Any], key: str, phase: str, figure: str) -> str:
    values = [
        r["rows"][key][phase][figure]
        for r in doc["results"]
        if r["config"] == BASELINE and phase in r.get("rows", {}).get(key, {})
    ]
    return f"{statistics.median(values):.1f}" if values else "-"


def table(doc: dict[str, Any]) -> str:
    """Rows per (dataset/concurrency, pass): each configuration's ratios to ``noop``, median [min-max] of repeats."""
    configs = list(dict.fromkeys(r["config"] for r in doc["results"] if "rows" in r))
    keys = list(dict.fromkeys(k for r in doc["results"] for k in r.get("rows", {})))
    loads = [p["load_avg_1m"] for r in doc["results"] for row in r.get("rows", {}).values() for p in row.values()]
    lines = [
        f"vllm serve + vLLM's bench serve client; {doc['cpus']} CPUs; {doc['minutes']} min; "
        f"ratios to the do-nothing connector of the same repeat, median [min-max] over repeats (vLLM's own per-pass"
        f" figures; ITL there is per chunk: see POOLED below for per-token ITL)",
    ]
    if loads:
        lines.append(f"machine load (1-min load average at the passes): {min(loads):.1f}-{max(loads):.1f}")
    for key in keys:
        for phase in ("cold", "hit", "load"):
            head = f"{key} {phase}"
            lines.append("")
            lines.append(f"{head:32s}" + "".join(f"{label:>20s}" for _, label in COLUMNS))
            ms = "".join(f"{baseline_ms(doc, key, phase, f) + UNITS.get(f, ' ms'):>20s}" for f, _ in COLUMNS)
            lines.append(f"{'  noop (absolute)':32s}{ms}")
            for config in configs:
                if config == BASELINE:
                    continue
                values = "".join(f"{cell(ratios(doc, key, phase, f, config)):>20s}" for f, _ in COLUMNS)
                lines.append(f"{'  ' + config:32s}{values}")
    moved = [f"{r['config']} r{r['repeat']}: {r['kvdi']}" for r in doc["results"] if r.get("kvdi")]
    if moved:
        lines += ["", "kvdi worker counters per server: " + "; ".join(moved)]
    extra = [r for r in doc["results"] if "multi_turn" in r]
    for r in extra:
        if isinstance(r["multi_turn"], str):
            lines.append(f"multi-turn {r['config']} r{r['repeat']}: {r['multi_turn']}")
    lines += multi_turn_table([r for r in extra if isinstance(r["multi_turn"], dict)])
    lines += pooled_table(doc, int(doc.get("args", {}).get("boots", 300)))
    return "\n".join(lines)


MULTI_TURN = (("ttft_p50_ms", "TTFT p50", " ms"), ("ttft_p90_ms", "TTFT p90", " ms"), ("run_s", "run", " s"))
ENGINE = (("engine_prefill_ms", "engine prefill", " ms"), ("engine_request_ms", "engine request", " ms"))  # no bar


def multi_turn_table(results: list[dict[str, Any]]) -> list[str]:
    """vLLM's multi-turn client: each configuration's figures over the do-nothing connector's of the same repeat."""
    if not results:
        return []
    by_repeat: dict[int, dict[str, dict[str, float]]] = {}
    for r in results:
        by_repeat.setdefault(r["repeat"], {})[r["config"]] = r["multi_turn"]
    shown = [*MULTI_TURN, *(f for f in ENGINE if any(f[0] in r["multi_turn"] for r in results))]
    head = "".join(f"{label:>20s}" for _, label, _ in shown) + f"{'bar (t interval)':>20s}"
    lines = ["", f"{'multi-turn (cache < conversations)':32s}" + head]
    base = [runs[BASELINE] for runs in by_repeat.values() if BASELINE in runs]
    if base:
        ms = "".join(absolute([b[f] for b in base if f in b], unit).rjust(20) for f, _, unit in shown)
        lines.append(f"{'  noop (absolute)':32s}{ms}")
    for config in dict.fromkeys(r["config"] for r in results):
        if config == BASELINE:
            continue
        cells, intervals = [], []
        for figure, _, _ in shown:
            values = [runs[config][figure] / runs[BASELINE][figure] for runs in by_repeat.values()
                      if figure in runs.get(config, {}) and runs.get(BASELINE, {}).get(figure)]  # fmt: skip
            cells.append(f"{cell(values):>20s}")
            intervals.append(repeat_interval(values))
        intervals = intervals[: len(MULTI_TURN)]  # the bar is on the client's figures; the engine's explain them
        limit = 1.0 if config.removesuffix("@before") in ("cpu_offload", "shared_storage") else None
        cells.append(f"{'-' if limit is None else judge(intervals, limit):>20s}")
        lines.append(f"{'  ' + config:32s}" + "".join(cells))
    return lines


def main() -> None:
    """Reprint the table of a saved run: ``python -m benchmarks.vllm.bench_serve_report RESULT.json``."""
    import json
    import sys
    from pathlib import Path

    print(table(json.loads(Path(sys.argv[1]).read_text())))


if __name__ == "__main__":
    main()
