"""Sliced rounds of the in-server A/B (:mod:`.bench_serve_switch` ``--slices S``): the two modes' passes of a
phase run next to each other, S times a round.

Why (``docs/bench-serve-power.md``, rounds ten and eleven): this 2-core host changes speed under the benchmark, in
stretches of about 2 s at half speed, and an unsliced round runs one mode's three passes (``cold``, ``hit``,
``load``, about 15 s) back to back before the other mode's: a slow stretch lands on one mode, and one round's ratio
has a standard deviation of 16-23 %. A sliced round splits the round's prompts into S slices, each of its own prompts
(its own seed), and runs each slice's six passes in the order of :func:`plan`: ``A cold, B cold, B hit, A hit,
A load, B load``. The two passes of a phase run one flip apart, each mode goes first in one phase and second in
the next, and ``A`` is ``noop`` in every other slice (swapped every round). A request still starts and ends in one
mode: the modes flip only while the server is idle. Each mode's figures of a phase are taken over all the round's
slices together (:func:`merge`): the server's inter-token histograms summed, the client's TTFTs pooled, counters
and CPU time summed. A store's ``load`` pass loads what its ``cold`` pass of the same slice stored.

Whether slicing helps is measured, not assumed: ``python -m benchmarks.vllm.bench_serve_slices <results file>...``
(:func:`spread`) reads the per-pass lines a results file keeps and prints, per configuration and pass, how much the
kvdi / noop ratio of one slice's two neighbouring passes spreads, and how much a round's merged ratio does: were the
host's slow stretches shorter than a pass, a round of S slices would spread about ``1/sqrt(S)`` as much as a pair;
and the slices' ratio split by the mode that ran first (:func:`position_ratios`), were the order to favour one.
Usage (any venv with numpy)::

    python -m benchmarks.vllm.bench_serve_slices benchmarks/results/bench_serve_switch-null-sliced-*.txt
"""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.vllm.bench_serve_stats import geometric_mean, histogram_quantiles, histogram_sum, run_document

FIGURES = ("server ITL p50", "server ITL p90", "server ITL mean", "TTFT p50", "TTFT p90")
"""A pass's figures (ms): the server's inter-token quantiles and mean, the client's time to first token."""
SUMMED = ("completed", "stalls", "stalled", "stolen", "stolen kept")
SUMMED_PREFIXES = ("kvdi ", "cpu ")
"""What a merged pass adds up over its slices: requests, reruns, and kvdi's counters and CPU ms."""


@dataclass
class Measured:
    """One pass: its figures (:data:`FIGURES` and the rest), and what they came from, for :func:`merge`."""

    figures: dict[str, float]
    hist: dict[str, float] = field(default_factory=dict)
    """The server's inter-token histogram over the pass (:func:`.bench_serve_stats.histogram_delta`)."""
    ttfts_ms: list[float] = field(default_factory=list)
    """The client's time to first token of each request that succeeded (ms)."""


def figures(hist: dict[str, float], ttfts_ms: Sequence[float]) -> dict[str, float]:
    """:data:`FIGURES` of a histogram and a set of TTFTs (numpy's linear percentiles, as vLLM's client takes them)."""
    p50, p90 = histogram_quantiles(hist)
    mean = hist["sum"] / hist["count"] * 1e3 if hist.get("count") else float("nan")
    ttft50, ttft90 = np.percentile(ttfts_ms, [50, 90]) if ttfts_ms else (float("nan"), float("nan"))
    return dict(zip(FIGURES, (p50, p90, mean, float(ttft50), float(ttft90)), strict=True))


def merge(passes: Sequence[Measured]) -> dict[str, float]:
    """The figures of several passes of one mode and phase taken together: :func:`figures` of the summed histograms
    and pooled TTFTs; :data:`SUMMED` and kvdi's counters and CPU ms summed; the client's ITL median, by which a
    pass was judged stalled, is the median of the passes'; the host's steal (%), the most any pass met."""
    hist = histogram_sum([p.hist for p in passes])
    out = figures(hist, [t for p in passes for t in p.ttfts_ms])
    keys = sorted({k for p in passes for k in p.figures if k in SUMMED or k.startswith(SUMMED_PREFIXES)})
    out |= {k: sum(p.figures.get(k, 0.0) for p in passes) for k in keys}
    client = [p.figures["client ITL p50"] for p in passes if "client ITL p50" in p.figures]
    if client:
        out["client ITL p50"] = statistics.median(client)
    steal = [p.figures["steal %"] for p in passes if "steal %" in p.figures]
    if steal:
        out["steal %"] = max(steal)
    return out | {"slices": float(len(passes))}


def plan(round_index: int, slices: int, modes: tuple[str, str]) -> list[tuple[int, str, str]]:
    """A sliced round's passes in order, as ``(slice, mode, phase)``: per slice ``A cold, B cold, B hit, A hit,
    A load, B load``, with ``A`` the first of ``modes`` in even slices of even rounds and in odd slices of odd ones:
    three flips a slice, and the next slice starts in the mode the last one ended in."""
    steps: list[tuple[int, str, str]] = []
    for i in range(slices):
        a = modes[(i + round_index) % 2]
        b = modes[1 - modes.index(a)]
        steps += [(i, a, "cold"), (i, b, "cold"), (i, b, "hit"), (i, a, "hit"), (i, a, "load"), (i, b, "load")]
    return steps


def slice_seed(round_index: int, slice_index: int) -> int:
    """The client's seed of a slice: its own prompts, the same in both modes, apart from the unsliced rounds'
    (``1000 + round``) and the warm-up's (10 000)."""
    return 100_000 + 100 * round_index + slice_index


PASS_LINE = re.compile(
    r"^  (?P<config>\S+) r(?P<round>\d+)\.(?P<slice>\d+) (?P<mode>noop|kvdi)\s+(?P<phase>cold|hit|load)\s+"
    r"server ITL p50 (?P<p50>[\d.]+) server ITL p90 (?P<p90>[\d.]+) server ITL mean (?P<mean>[\d.]+)"
)
"""A sliced pass as :mod:`.bench_serve_switch` prints it (``  <config> r<round>.<slice> <mode> <phase> ...``)."""
SPREAD_FIGURES = {"p50": "server ITL p50", "p90": "server ITL p90", "mean": "server ITL mean"}


def slice_passes(lines: Iterable[str]) -> dict[tuple[str, str, str, str], dict[str, dict[str, float]]]:
    """Each slice's passes of a phase, by (configuration, phase, round, slice): each mode's figures (p50, p90,
    mean), the modes in the order their passes ran (the order of the lines: a rerun prints its kept pass once)."""
    seen: dict[tuple[str, str, str, str], dict[str, dict[str, float]]] = {}
    for line in lines:
        m = PASS_LINE.match(line)
        if m:  # a pass printed twice (it cannot be: reruns print once) would keep its last line
            key = (m["config"], m["phase"], m["round"], m["slice"])
            seen.setdefault(key, {})[m["mode"]] = {k: float(m[k]) for k in SPREAD_FIGURES}
    return seen


def pair_ratios(lines: Iterable[str]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Per (configuration, phase): the kvdi / noop ratio of each slice's two passes, by figure (p50, p90, mean)."""
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    for (config, phase, _, _), modes in slice_passes(lines).items():
        if len(modes) == 2:
            ratios = out.setdefault((config, phase), {k: [] for k in SPREAD_FIGURES})
            for k in SPREAD_FIGURES:
                ratios[k].append(modes["kvdi"][k] / modes["noop"][k])
    return out


def position_ratios(lines: Iterable[str]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """Per (configuration, phase): each slice's kvdi / noop ratio of the server's ITL p50, split by the mode whose
    pass ran first (``kvdi first``, ``noop first``)."""
    out: dict[tuple[str, str], dict[str, list[float]]] = {}
    for (config, phase, _, _), modes in slice_passes(lines).items():
        if len(modes) == 2:
            split = out.setdefault((config, phase), {"kvdi first": [], "noop first": []})
            split[f"{next(iter(modes))} first"].append(modes["kvdi"]["p50"] / modes["noop"]["p50"])
    return out


def log_sd(ratios: Sequence[float]) -> float:
    """The sample standard deviation of the ratios' logarithms (about the relative spread of one ratio)."""
    return float(np.log(np.asarray(ratios, dtype=float)).std(ddof=1)) if len(ratios) > 1 else float("nan")


def spread(text: str) -> list[str]:
    """Per configuration and pass of one results file: one slice pair's spread and one round's, in % (log SD), for
    the server's ITL p50, p90 and mean, beside what a round would spread were its pairs independent."""
    doc = run_document(text.splitlines())
    if doc is None:
        raise ValueError("it holds no bench_serve_switch run document")
    slices = int(doc.get("args", {}).get("slices", 1))
    rounds: dict[str, list[dict[str, Any]]] = {}  # every server's rounds (``--servers``: one result a server)
    for result in doc.get("results", []):
        rounds.setdefault(result["config"], []).extend(result.get("rounds", []))
    lines = []
    for (config, phase), ratios in pair_ratios(text.splitlines()).items():
        kept = rounds.get(config, [])
        cells = []
        for short, figure in SPREAD_FIGURES.items():
            pair = log_sd(ratios[short])
            whole = log_sd([r["kvdi"][phase][figure] / r["noop"][phase][figure] for r in kept])
            cells.append(f"{short} {pair:.1%} / {whole:.1%} ({pair / slices**0.5:.1%})")
        lines.append(f"{config} {phase}: {len(ratios['p50'])} pairs, {len(kept)} rounds of {slices}; spread of a "
                     "pair / of a round (a round of independent pairs): " + ", ".join(cells))  # fmt: skip
    for (config, phase), split in position_ratios(text.splitlines()).items():
        cells = [f"{who} {geometric_mean(r):.3f} ({len(r)} pairs)" for who, r in split.items() if r]
        lines.append(f"{config} {phase}: ITL p50 kvdi / noop by the pass that ran first (geometric mean): "
                     + ", ".join(cells))  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    paths = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m benchmarks.vllm.bench_serve_slices <results file>...", file=sys.stderr)
        return 2
    for path in paths:
        try:
            found = spread(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            print(f"{path}: cannot be read as a sliced results file ({exc!s:.120})", file=sys.stderr)
            return 2
        if not found:
            print(f"{path}: holds no sliced passes (lines '  <config> r<round>.<slice> <mode> <phase> ...')",
                  file=sys.stderr)  # fmt: skip
            return 2
        print(f"{path}:", *found, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
