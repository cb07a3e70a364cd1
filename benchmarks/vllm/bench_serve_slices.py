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
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from benchmarks.vllm.bench_serve_stats import histogram_quantiles, histogram_sum

FIGURES = ("server ITL p50", "server ITL p90", "server ITL mean", "TTFT p50", "TTFT p90")
"""A pass's figures (ms): the server's inter-token quantiles and mean, the client's time to first token."""
SUMMED = ("completed", "stalls", "stalled")
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
    pass was judged stalled, is the median of the passes'."""
    hist = histogram_sum([p.hist for p in passes])
    out = figures(hist, [t for p in passes for t in p.ttfts_ms])
    keys = sorted({k for p in passes for k in p.figures if k in SUMMED or k.startswith(SUMMED_PREFIXES)})
    out |= {k: sum(p.figures.get(k, 0.0) for p in passes) for k in keys}
    client = [p.figures["client ITL p50"] for p in passes if "client ITL p50" in p.figures]
    if client:
        out["client ITL p50"] = statistics.median(client)
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
