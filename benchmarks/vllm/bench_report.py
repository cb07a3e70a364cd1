"""Figures, ratios and the human table of ``bench_vllm.py``, from the engines' raw phase results.

Every figure is one value per engine (for example the median of that engine's steady-state
rounds), summarised over the engines of a configuration as the median with its min-max
spread. A ratio pairs each engine with the baseline engine of the same repeat (they ran next
to each other, so slow spells of the shared host hit both), and reports the median of the
paired ratios with their min-max.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

Engine = dict[str, Any]  # {"repeat": r, "phases": {name: phase result}}
Value = Callable[[Engine], "float | None"]


def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "n"}`` of ``values`` (``None`` figures when empty)."""
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": med(values), "min": min(values), "max": max(values), "n": len(values)}


def phase_s(name: str) -> Value:
    """An engine's wall time for phase ``name``."""
    return lambda e: e["phases"][name]["seconds"] if name in e["phases"] else None


def rounds_s(prefix: str) -> Value:
    """Median wall time of an engine's phases ``prefix_1``, ``prefix_2``..."""

    def value(e: Engine) -> float | None:
        times = [p["seconds"] for n, p in e["phases"].items() if n.startswith(prefix + "_")]
        return med(times) if times else None

    return value


def later_rounds_s(prefix: str) -> Value:
    """Median wall time of an engine's phases ``prefix_2``, ``prefix_3``... (the first left out)."""

    def value(e: Engine) -> float | None:
        times = [p["seconds"] for n, p in e["phases"].items() if n.startswith(prefix + "_") and n != prefix + "_1"]
        return med(times) if times else None

    return value


def ttft(name: str) -> Value:
    """Median time to first token of an engine's requests in phase ``name``."""
    return lambda e: med(e["phases"][name]["ttft_s"]) if name in e["phases"] else None


def itl(name: str) -> Value:
    """Median inter-token gap of the running requests in mix phase ``name``."""
    return lambda e: med(e["phases"][name]["itl_s"]) if e["phases"].get(name, {}).get("itl_s") else None


def arrival_ttft(name: str) -> Value:
    return lambda e: med(e["phases"][name]["arrival_ttft_s"]) if name in e["phases"] else None


def per_engine(engines: list[Engine], value: Value, *, skip_first: bool = False) -> dict[int, float]:
    """``{repeat: value}`` over ``engines`` (repeat 0 left out with ``skip_first``: nothing stored before it)."""
    out: dict[int, float] = {}
    for e in engines:
        if skip_first and e["repeat"] == 0:
            continue
        v = value(e)
        if v is not None:
            out[e["repeat"]] = v
    return out


def paired_ratio(num: dict[int, float], den: dict[int, float]) -> dict[str, Any]:
    """Median and min-max of ``num[r] / den[r]`` over the repeats both have."""
    return spread([num[r] / den[r] for r in sorted(num) if r in den and den[r] > 0])


def verdict(ratio: dict[str, Any], target: str) -> str:
    """'yes' / 'no' for targets written ``<= x`` or ``< x`` (judged on the median), '—' otherwise."""
    m = ratio.get("median")
    if m is None or not target or target[0] not in "<>":
        return "—"
    op, _, bound = target.partition(" ")
    limit = float(bound)
    ok = {"<=": m <= limit, "<": m < limit, ">=": m >= limit, ">": m > limit}[op]
    return "yes" if ok else "no"


def fmt(s: dict[str, Any], scale: float = 1.0, unit: str = "") -> str:
    if s.get("median") is None:
        return "n/a"
    return f"{s['median'] * scale:.3f}{unit} [{s['min'] * scale:.3f}-{s['max'] * scale:.3f}]"


def figures(engines: dict[str, list[Engine]], phase_names: list[str]) -> dict[str, Any]:
    """Per configuration: every phase's wall time and median TTFT, mix ITLs, as median [min-max] over engines."""
    out: dict[str, Any] = {}
    for cfg, runs in engines.items():
        fig: dict[str, Any] = {}
        for name in phase_names:
            skip = name.startswith("b_")
            fig[name] = {
                "round_s": spread(list(per_engine(runs, phase_s(name), skip_first=skip).values())),
                "ttft_s": spread(list(per_engine(runs, ttft(name), skip_first=skip).values())),
            }
            if name.startswith("e_"):
                fig[name]["itl_s"] = spread(list(per_engine(runs, itl(name)).values()))
                fig[name]["arrival_ttft_s"] = spread(list(per_engine(runs, arrival_ttft(name)).values()))
        out[cfg] = fig
    return out


def ratio_rows(engines: dict[str, list[Engine]], process_local: set[str]) -> list[dict[str, Any]]:
    """The ratios of the bars inside vLLM (and context rows), one dict per row, for each prefix-caching setting."""
    rows: list[dict[str, Any]] = []

    def add(what: str, cfg: str, num: dict[int, float], den: dict[int, float], target: str, note: str = "") -> None:
        r = paired_ratio(num, den)
        rows.append(
            {"what": what, "config": cfg, "ratio": r, "target": target, "met": verdict(r, target), "note": note}
        )

    stores = tuple(
        c
        for c in (
            "kvdi-shared_storage",
            "kvdi-cpu_offload",
            "kvdi-redis",
            "kvdi-redis-syncload",
            "kvdi-shared_storage-syncsave",
            "kvdi-shared_storage-asyncload",
            "kvdi-shared_storage-canonical",
        )
    )
    for pc in ("on", "off"):

        def runs(name: str, pc: str = pc) -> list[Engine]:
            return engines.get(f"{name}/pc-{pc}", [])

        none = runs("no-connector")
        if not none:
            continue
        for cfg in ("kvdi-null", "vllm-example", *stores):
            if not runs(cfg):
                continue
            key = f"{cfg}/pc-{pc}"
            add(
                "storing round (a_1, nothing cached) / no connector",
                key,
                per_engine(runs(cfg), phase_s("a_1")),
                per_engine(none, phase_s("a_1")),
                "<= 1.05",
            )
            add(
                "no-reuse rounds (median of a_2..) / no connector",
                key,
                per_engine(runs(cfg), later_rounds_s("a")),
                per_engine(none, later_rounds_s("a")),
                "<= 1.03",
            )
            c_target = "<= 1.03" if pc == "on" else ""
            add(
                "steady state (c, same prompts again) / no connector",
                key,
                per_engine(runs(cfg), rounds_s("c")),
                per_engine(none, rounds_s("c")),
                c_target,
                "local hits" if pc == "on" else "connector loads vs recompute",
            )
            add(
                "shared system prompt (d) / no connector",
                key,
                per_engine(runs(cfg), rounds_s("d")),
                per_engine(none, rounds_s("d")),
                "",
            )
        null = runs("kvdi-null")
        for cfg in stores:
            if runs(cfg) and null:
                add(
                    "shared_storage-like vs kvdi null: steady state (c)",
                    f"{cfg}/pc-{pc}",
                    per_engine(runs(cfg), rounds_s("c")),
                    per_engine(null, rounds_s("c")),
                    "",
                    "issue 9: within noise of null",
                )
        canonical, per_rank = runs("kvdi-shared_storage-canonical"), runs("kvdi-shared_storage")
        for phase, skip in (("a_1", False), ("b_load", True)) if canonical and per_rank else ():
            add(
                f"canonical format / per-rank format, shared_storage: {phase}",
                f"kvdi-shared_storage-canonical/pc-{pc}",
                per_engine(canonical, phase_s(phase), skip_first=skip),
                per_engine(per_rank, phase_s(phase), skip_first=skip),
                "",
                "docs/stored-format.md",
            )
        # (b): a second engine loading what the previous engine stored; process-local stores
        # cannot be read by another engine, so theirs is the round after vLLM's cache was dropped.
        hit_ref = per_engine(runs("no-connector", "on"), rounds_s("c"))
        example_load = per_engine(runs("vllm-example"), phase_s("b_load"), skip_first=True)
        for cfg in ("vllm-example", *stores):
            if not runs(cfg):
                continue
            load_phase = "reset_load" if cfg in process_local else "b_load"
            load = per_engine(runs(cfg), phase_s(load_phase), skip_first=load_phase == "b_load")
            if pc == "on":
                hit_phase = "c" if cfg in process_local else "b_hit"
                hit = per_engine(runs(cfg), phase_s(hit_phase) if hit_phase == "b_hit" else rounds_s("c"))
                add(
                    f"loading round ({load_phase}) / same engine's round with vLLM's prefix cache holding it",
                    f"{cfg}/pc-{pc}",
                    load,
                    hit,
                    "<= 1.2",
                )
            else:
                add(
                    f"loading round ({load_phase}) / no-connector round with vLLM's prefix cache holding it (pc on)",
                    f"{cfg}/pc-{pc}",
                    load,
                    hit_ref,
                    "<= 1.2",
                )
            if cfg != "vllm-example":
                add(
                    f"loading round ({load_phase}) / ExampleConnector's loading round (b_load)",
                    f"{cfg}/pc-{pc}",
                    load,
                    example_load,
                    "< 1",
                )
        for cfg in ("no-connector", "kvdi-null", "vllm-example", *stores):
            if runs(cfg):
                add(
                    "(e) running requests' median ITL with loads / same workload without loads",
                    f"{cfg}/pc-{pc}",
                    per_engine(runs(cfg), itl("e_load")),
                    per_engine(runs(cfg), itl("e_noload")),
                    "<= 1.1" if pc == "on" and cfg in stores else "",
                    "no connector/null: arrivals recompute; without loads = arrivals hit vLLM's prefix cache",
                )
    return rows


def table(doc: dict[str, Any]) -> str:
    """The human-readable table: every ratio next to its target, then every figure per configuration."""
    lines = ["RATIOS (median of paired per-repeat ratios [min-max], n)", ""]
    for row in doc["ratios"]:
        r = row["ratio"]
        lines.append(
            f"{row['config']:<30} {row['what']:<100} {fmt(r):>24} n={r['n']}  "
            f"target {row['target'] or '—':<7} met {row['met']}" + (f"  ({row['note']})" if row["note"] else "")
        )
    lines += ["", "FIGURES (per configuration: round wall time s, median TTFT ms; median [min-max] over engines)", ""]
    for cfg, fig in doc["figures"].items():
        lines.append(cfg)
        for name, f in fig.items():
            extra = ""
            if "itl_s" in f:
                extra = f"  ITL {fmt(f['itl_s'], 1000, 'ms')}  arrival TTFT {fmt(f['arrival_ttft_s'], 1000, 'ms')}"
            lines.append(
                f"  {name:<11} round {fmt(f['round_s'], 1, 's'):<28} TTFT {fmt(f['ttft_s'], 1000, 'ms')}{extra}"
            )
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    """The README table: one row per target ratio and prefix-caching setting, one column per configuration.

    A cell is the median of the paired ratios with its [min-max]; ``(no)`` marks a missed target.
    """
    configs: list[str] = []
    rows: dict[tuple[str, str, str], dict[str, str]] = {}
    for row in doc["ratios"]:
        if not row["target"]:
            continue
        cfg, _, pc = row["config"].rpartition("/")
        if cfg not in configs:
            configs.append(cfg)
        r = row["ratio"]
        cell = "n/a" if r["median"] is None else f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"
        rows.setdefault((row["what"], pc, row["target"]), {})[cfg] = cell + (" (no)" if row["met"] == "no" else "")
    head = ["ratio", "prefix cache", "target", *configs]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (what, pc, target), cells in rows.items():
        lines.append(
            f"| {what} | {pc.removeprefix('pc-')} | {target} | " + " | ".join(cells.get(c, "") for c in configs) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``python bench_report.py RESULT.json``: the tables again from a saved document."""
    import json

    with open(argv[1], encoding="utf-8") as fh:
        doc = json.load(fh)
    print(table(doc))
    print()
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv))
