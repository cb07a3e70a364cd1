"""Figures, ratios and tables of ``bench_remote.py``, from its engines' raw phase results.

Each figure is one value per engine (a phase's wall time, a mix phase's median ITL, the median
engine steps of its asynchronous loads), summarised over the repeats as median [min-max]. A
ratio pairs values of the same repeat (engines that ran next to each other) and reports the
median of the paired ratios with their min-max; targets are judged on that median.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.vllm.bench_report import Engine, Value, fmt, paired_ratio, per_engine, spread, verdict

STEP_COUNTERS = {1: "load_steps_1", 2: "load_steps_2", 3: "load_steps_3", 4: "load_steps_4_or_more"}


def pooled(name: str, d: str, field: str) -> Value:
    """Median of ``field`` (``seconds``, or a list: ``ttft_s``, ``itl_s``) over an engine's rounds ``name@d#k``."""

    def value(e: Engine) -> float | None:
        got: list[float] = []
        for n, p in e["phases"].items():
            if n.startswith(f"{name}@{d}#"):
                got += p[field] if isinstance(p[field], list) else [p[field]]
        return statistics.median(got) if got else None

    return value


def itl_p90(d: str, name: str) -> Value:
    """90th percentile of the running requests' inter-token gaps over an engine's rounds ``name@d#k``."""

    def value(e: Engine) -> float | None:
        gaps = [g for n, p in e["phases"].items() if n.startswith(f"{name}@{d}#") for g in p["itl_s"]]
        return statistics.quantiles(gaps, n=10)[8] if len(gaps) >= 2 else None

    return value


def steps_per_load(delay: str) -> Value:
    """An engine's median engine steps per asynchronous load during delay ``delay``'s phases (4 = 4 or more),
    from kvdi's worker counters read at the delay's barrier and at the next one (or at the end)."""

    def value(e: Engine) -> float | None:
        snaps, order = e.get("worker_counters_at", {}), e.get("delay_order", [])
        if delay not in order:
            return None
        after = order[order.index(delay) + 1] if order.index(delay) + 1 < len(order) else "end"
        if delay not in snaps or after not in snaps:
            return None
        counts = [
            steps
            for steps, name in STEP_COUNTERS.items()
            for _ in range(int(snaps[after].get(name, 0) - snaps[delay].get(name, 0)))
        ]
        return statistics.median(counts) if counts else None

    return value


def load_over_hit_and_raw(d: str, raw: dict[int, float]) -> Value:
    """An engine's loading round / (its local-hit round + the raw transfer of the same repeat); medians of rounds."""

    def value(e: Engine) -> float | None:
        load, hit = pooled("b_load", d, "seconds")(e), pooled("b_hit", d, "seconds")(e)
        if load is None or hit is None or e["repeat"] not in raw:
            return None
        return load / (hit + raw[e["repeat"]])

    return value


def report(doc: dict[str, Any]) -> dict[str, Any]:
    """``{"figures": ..., "ratios": [...]}`` for ``doc`` (engines, raw_transfer, setup)."""
    setup, engines = doc["setup"], doc["engines"]
    delays = [f"{d:g}" for d in setup["delays_ms_each_way"]]
    by_delay = setup["auto"].get("by_delay") or {}  # runs made before auto measured the lookup: one pick
    figures: dict[str, Any] = {}
    ratios: list[dict[str, Any]] = []
    for d in delays:
        by_repeat: dict[int, dict[str, list[float]]] = {}
        for k, v in doc["raw_transfer"].items():
            r, _, rest = k.partition("@")
            if rest.split("#")[0] == d:
                for via in ("proxy", "direct"):
                    by_repeat.setdefault(int(r), {"proxy": [], "direct": []})[via].append(v[via]["seconds"])
        raw = {r: statistics.median(v["proxy"]) for r, v in by_repeat.items()}
        direct = [statistics.median(v["direct"]) for v in by_repeat.values()]
        figures[f"raw@{d}"] = {"proxy_s": spread(list(raw.values())), "direct_s": spread(direct)}
        for mode in setup["modes"]:

            def runs(path: str, mode: str = mode) -> list[Engine]:
                return list(engines.get(f"{mode}/{path}", []))

            def add(
                path: str, what: str, value: dict[str, Any], target: str, note: str = "", d: str = d, mode: str = mode
            ) -> None:
                ratios.append(
                    {
                        "delay_ms": d,
                        "mode": mode,
                        "path": path,
                        "what": what,
                        "ratio": value,
                        "target": target,
                        "met": verdict(value, target),
                        "note": note,
                    }
                )

            for path in setup["paths"]:
                e = runs(path)
                fig: dict[str, Any] = {
                    name: {
                        "round_s": spread(list(per_engine(e, pooled(name, d, "seconds")).values())),
                        "ttft_s": spread(list(per_engine(e, pooled(name, d, "ttft_s")).values())),
                    }
                    for name in ("b_load", "b_hit", "e_load", "e_noload")
                }
                for name in ("e_load", "e_noload"):
                    fig[name]["itl_s"] = spread(list(per_engine(e, pooled(name, d, "itl_s")).values()))
                    fig[name]["itl_p90_s"] = spread(list(per_engine(e, itl_p90(d, name)).values()))
                    fig[name]["arrival_ttft_s"] = spread(
                        list(per_engine(e, pooled(name, d, "arrival_ttft_s")).values())
                    )
                fig["steps_per_async_load"] = spread(list(per_engine(e, steps_per_load(d)).values()))
                figures[f"{mode}/{path}@{d}"] = fig
                is_auto = path == by_delay.get(d, setup["auto"]["path"])
                tag = "auto's pick" if is_auto else ""
                add(
                    path,
                    "ITL of running requests while arrivals load / same workload, arrivals hit vLLM's cache",
                    paired_ratio(
                        per_engine(e, pooled("e_load", d, "itl_s")), per_engine(e, pooled("e_noload", d, "itl_s"))
                    ),
                    "<= 1.1" if is_auto else "",
                    tag,
                )
                add(
                    path,
                    "90th-percentile ITL, the same pair (the stalled steps)",
                    paired_ratio(per_engine(e, itl_p90(d, "e_load")), per_engine(e, itl_p90(d, "e_noload"))),
                    "",
                )
                add(
                    path,
                    "loading round / (local-hit round + raw transfer through the proxy)",
                    spread(list(per_engine(e, load_over_hit_and_raw(d, raw)).values())),
                    "<= 1.3" if is_auto else "",
                    tag,
                )
                add(
                    path,
                    "loading round / same engine's round with vLLM's prefix cache holding it",
                    paired_ratio(
                        per_engine(e, pooled("b_load", d, "seconds")), per_engine(e, pooled("b_hit", d, "seconds"))
                    ),
                    "<= 1.3" if path == "on" else "",
                )
                if path != "off" and runs("off"):
                    add(
                        path,
                        "loading round / the same load done synchronously (off)",
                        paired_ratio(
                            per_engine(e, pooled("b_load", d, "seconds")),
                            per_engine(runs("off"), pooled("b_load", d, "seconds")),
                        ),
                        "<= 1.1" if path == "on" else "",
                    )
                if path == "on":
                    add(path, "engine steps per asynchronous load (median)", fig["steps_per_async_load"], "<= 2")
    return {"figures": figures, "ratios": ratios}


def table(doc: dict[str, Any]) -> str:
    """The human table: the setup line, every ratio next to its target, every figure; then the markdown table."""
    s = doc["setup"]
    load = s["load_average_1min_after_each_engine"]
    lines = [
        f"bench_remote: {s['repeats']} repeats, delays {s['delays_ms_each_way']} ms each way, on a {s['cpus']}-core "
        f"machine shared with other jobs (1-min load average after each engine {load['median']:.1f} "
        f"[{load['min']:.1f}-{load['max']:.1f}]): noisy figures",
        f"auto picks {s['auto'].get('by_delay') or repr(s['auto']['path'])} here ({s['auto']['why']}); "
        "it is not run separately",
        f"tokens identical across engines: {doc['tokens_identical']} ({doc['token_mismatches']} mismatches)",
        "",
        "RATIOS (median of per-repeat ratios [min-max], n)",
    ]
    for row in doc["ratios"]:
        r = row["ratio"]
        lines.append(
            f"{row['delay_ms']:>3}ms {row['mode']:<12} {row['path']:<8} {row['what']:<90} {fmt(r):>22} n={r['n']}  "
            f"target {row['target'] or '—':<7} met {row['met']}" + (f"  ({row['note']})" if row["note"] else "")
        )
    lines += ["", "FIGURES (round wall time s, median TTFT ms, median ITL ms; median [min-max] over repeats)"]
    for key, fig in doc["figures"].items():
        if key.startswith("raw@"):
            lines.append(
                f"{key:<28} raw transfer via proxy {fmt(fig['proxy_s'], 1000, 'ms')}  "
                f"direct {fmt(fig['direct_s'], 1000, 'ms')}"
            )
            continue
        lines.append(f"{key}  steps per async load {fmt(fig['steps_per_async_load'])}")
        for name in ("b_load", "b_hit", "e_load", "e_noload"):
            f = fig[name]
            extra = ""
            if "itl_s" in f:
                extra = (
                    f"  ITL {fmt(f['itl_s'], 1000, 'ms')}  p90 {fmt(f['itl_p90_s'], 1000, 'ms')}"
                    f"  arrival TTFT {fmt(f['arrival_ttft_s'], 1000, 'ms')}"
                )
            lines.append(
                f"  {name:<9} round {fmt(f['round_s'], 1, 's'):<26} TTFT {fmt(f['ttft_s'], 1000, 'ms')}{extra}"
            )
    return "\n".join([*lines, "", markdown(doc)])


def markdown(doc: dict[str, Any]) -> str:
    """One row per (delay, mode, ratio), one column per load path; ``(no)`` marks a missed target, ``*`` its row."""
    paths = doc["setup"]["paths"]
    rows: dict[tuple[str, str, str], dict[str, str]] = {}
    for row in doc["ratios"]:
        r = row["ratio"]
        cell = "n/a" if r["median"] is None else f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"
        if row["target"]:
            cell += f" (target {row['target']}: {'met' if row['met'] == 'yes' else 'not met'})"
        rows.setdefault((row["delay_ms"], row["mode"], row["what"]), {})[row["path"]] = cell
    head = ["delay each way", "engine core", "figure", *paths]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for (d, mode, what), cells in rows.items():
        lines.append(f"| {d} ms | {mode} | {what} | " + " | ".join(cells.get(p, "") for p in paths) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``python -m benchmarks.vllm.bench_remote_report RESULT.json``: the table again from a saved document
    (figures and ratios recomputed from its engines)."""
    import json

    with open(argv[1], encoding="utf-8") as fh:
        doc = json.load(fh)
    doc.update(report(doc))
    print(table(doc))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv))
