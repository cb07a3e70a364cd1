"""The statistics of :mod:`.bench_serve` (vLLM-free): per-token ITL from vLLM's client's chunk gaps, pooled
quantile ratios with a bootstrap interval, and the server's CPU time per generated token.

Why per-token ITL needs work: vLLM's client (``vllm/benchmarks/lib/endpoint_request_func.py``) records one ITL per
SSE chunk it *parses*, stamped when its ``iter_any()`` read returns. When the API server or the client is scheduled
late (a 2-core machine, a busy one above all), several chunks land in one read: the first gap holds all the time,
the others read ~0 ms, and the ITL median of a pass comes out 0.00 (measured on this machine, load 2.5: 494 of 504
gaps under 0.2 ms, each request's 64 tokens in one burst at its end). :func:`deburst` spreads such a burst's time
evenly over its chunks, which keeps each request's total decode time and makes every sample one token's share.

Why pooled quantiles: a pass gives a few thousand ITL samples but only one p50 per server; two or three repeats
of a p50 spread 0.7-1.5x on a shared machine. Pooling every request's samples of every repeat of a configuration,
then bootstrapping over *requests* (a request's samples are not independent), gives the ratio's interval:
:func:`verdict` says "pass" only when the interval's top is under the bar, "FAIL" when its bottom is above it.

Why CPU per token: the server's process group's ``utime + stime`` (``/proc/<pid>/stat``) before and after a pass,
over the tokens generated, counts what kvdi adds to the engine core and worker processes, and is far less moved by
other processes on the machine than wall-clock latency is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

BURST_S = 2e-4  # chunks read within 0.2 ms of the previous one arrived together (one step takes ~2.5 ms)
QUANTILES = (0.5, 0.9)


def deburst(gaps_s: Sequence[float], burst_s: float = BURST_S) -> list[float]:
    """One request's chunk gaps (s) as per-token gaps (ms): each gap followed by gaps under ``burst_s`` is a burst
    of chunks that arrived together, and each of them gets the burst's total over its length."""
    out: list[float] = []
    i = 0
    while i < len(gaps_s):
        j = i + 1
        while j < len(gaps_s) and gaps_s[j] < burst_s:
            j += 1
        share = sum(gaps_s[i:j]) / (j - i) * 1e3
        out += [share] * (j - i)
        i = j
    return out


def burst_fraction(itls: Sequence[Sequence[float]], burst_s: float = BURST_S) -> float:
    """The fraction of chunk gaps under ``burst_s`` over all requests (0 when every token arrived on its own)."""
    gaps = [g for request in itls for g in request]
    return sum(g < burst_s for g in gaps) / len(gaps) if gaps else 0.0


def per_request(result: dict[str, object]) -> dict[str, list[list[float]] | list[float] | float]:
    """The samples of one pass from vLLM's client's detailed result (``--save-detailed``): per request, its
    per-token ITLs (ms, :func:`deburst`) and its TPOT (ms: (latency - TTFT) over its tokens but the first)."""
    itls = [list(map(float, r)) for r in result["itls"]]  # type: ignore[attr-defined]
    ttfts = list(map(float, result["ttfts"]))  # type: ignore[call-overload]
    latencies = list(map(float, result["latencies"]))  # type: ignore[call-overload]
    lens = list(map(int, result["output_lens"]))  # type: ignore[call-overload]
    tpot = [(lat - ttft) / (n - 1) * 1e3 for ttft, lat, n in zip(ttfts, latencies, lens, strict=True) if n > 1]
    return {
        "itl_ms": [[round(x, 4) for x in deburst(r)] for r in itls if r],
        "tpot_ms": [round(x, 4) for x in tpot],
        "burst_fraction": round(burst_fraction(itls), 4),
    }


def pooled_quantiles(requests: Sequence[Sequence[float]], qs: Sequence[float] = QUANTILES) -> list[float]:
    values = np.concatenate([np.asarray(r, dtype=float) for r in requests if len(r)])
    return [float(x) for x in np.quantile(values, qs)]


def ratio_interval(
    base: Sequence[Sequence[float]],
    other: Sequence[Sequence[float]],
    qs: Sequence[float] = QUANTILES,
    boots: int = 300,
    level: float = 0.9,
    seed: int = 0,
) -> list[tuple[float, float, float]]:
    """Per quantile ``q``: (``other``'s pooled q over ``base``'s, and the ``level`` bootstrap interval of that
    ratio), resampling whole requests (lists of samples) with replacement within each side."""
    rng = np.random.default_rng(seed)

    def boot(requests: Sequence[Sequence[float]]) -> np.ndarray:
        arrays = [np.asarray(r, dtype=float) for r in requests if len(r)]
        lengths = np.array([len(a) for a in arrays])
        flat = np.concatenate(arrays)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        out = np.empty((boots, len(qs)))
        for b in range(boots):
            pick = rng.integers(0, len(arrays), len(arrays))
            index = np.concatenate([np.arange(starts[p], starts[p] + lengths[p]) for p in pick])
            out[b] = np.quantile(flat[index], qs)
        return out

    point = np.array(pooled_quantiles(other, qs)) / np.array(pooled_quantiles(base, qs))
    ratios = boot(other) / boot(base)
    tail = (1 - level) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail], axis=0)
    return [(float(p), float(lo), float(hi)) for p, lo, hi in zip(point, low, high, strict=True)]


def verdict(interval: tuple[float, float, float], bar: float) -> str:
    """``pass`` when the interval's top is at most ``bar``, ``FAIL`` when its bottom is above it, else ``undecided``."""
    _, low, high = interval
    if high <= bar:
        return "pass"
    return "FAIL" if low > bar else "undecided"


def _stat_fields(text: str) -> tuple[str, list[str]]:
    """A ``/proc/<pid>/stat`` line's command name and the fields after it (the name may hold spaces)."""
    return text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()


def group_cpu_s(pgid: int, proc: Path = Path("/proc")) -> dict[str, float]:
    """CPU seconds (user + system, every thread) of each process in process group ``pgid``, summed per command
    name (vLLM names its engine core ``VLLM::EngineCor``); processes that ended are not counted."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name, fields = _stat_fields((entry / "stat").read_text())
        except (OSError, ValueError):
            continue
        if int(fields[2]) == pgid:  # fields: state ppid pgrp session ... utime(11) stime(12)
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds spent between two :func:`group_cpu_s` readings, per command name, and ``total``."""
    delta = {name: round(after[name] - before.get(name, 0.0), 3) for name in after}
    return delta | {"total": round(sum(delta.values()), 3)}


# vLLM's own inter-token histogram, fed with the engine core's output timestamps (``EngineCoreOutputs.timestamp``,
# ``vllm/v1/metrics/stats.py``): the gap between two steps' outputs as the engine made them, untouched by when the
# API server or the client got to run. ``--custom-histogram-buckets`` makes its buckets fine enough for quantiles.
ITL_METRIC = "vllm:inter_token_latency_seconds"
ITL_BUCKETS_S = [round(0.0005 + 0.000025 * i, 6) for i in range(301)] + [0.009, 0.01, 0.0125, 0.015, 0.02, 0.03]
ITL_BUCKETS_S += [0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
TTFT_BUCKETS_S = [round(0.001 * i, 3) for i in range(1, 201)] + [0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
"""vLLM's time-to-first-token histogram (log stats on), 1 ms apart up to 200 ms: quantiles of a multi-turn run."""


def counter_totals(metrics_text: str) -> dict[str, float]:
    """Every counter (``<family>_total``) in a Prometheus text page, by family name without ``_total``, summed over
    its label sets."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        name, _, value = line.rpartition(" ")
        family = name.split("{")[0]
        if family.endswith("_total") and not line.startswith("#"):
            short = family.removesuffix("_total")
            out[short] = out.get(short, 0.0) + float(value)
    return out


def itl_histogram(metrics_text: str, metric: str = ITL_METRIC) -> dict[str, float]:
    """Cumulative bucket counts by upper bound (``le`` as written, ``+Inf`` included), ``_sum`` and ``_count`` of
    ``metric`` in a Prometheus text page, summed over its label sets."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith(metric):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith(metric + "_bucket"):
            le = name[name.index('le="') + 4 :]
            key = le[: le.index('"')]
        elif name.startswith((metric + "_sum", metric + "_count")):
            key = name[len(metric) + 1 :].split("{")[0]
        else:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


def histogram_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


def histogram_quantiles(hist: dict[str, float], qs: Sequence[float] = QUANTILES) -> list[float]:
    """Quantiles (ms) of a cumulative histogram (:func:`itl_histogram`), linear within a bucket; nan when empty."""
    bounds = sorted((float(k), v) for k, v in hist.items() if k not in ("sum", "count", "+Inf"))
    total = hist.get("+Inf", bounds[-1][1] if bounds else 0.0)
    out = []
    for q in qs:
        if total <= 0:
            out.append(float("nan"))
            continue
        rank, low, below = q * total, 0.0, 0.0
        value = bounds[-1][0] if bounds else float("nan")
        for bound, cumulative in bounds:
            if cumulative >= rank:
                inside = cumulative - below
                value = low + (bound - low) * ((rank - below) / inside if inside else 1.0)
                break
            low, below = bound, cumulative
        out.append(value * 1e3)
    return out


def histogram_sum(hists: Sequence[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for hist in hists:
        for key, value in hist.items():
            out[key] = out.get(key, 0.0) + value
    return out


# two-sided 90% Student t quantiles (0.95) by degrees of freedom; 1.75 (that of 15) above: a little wide past 15
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
       11: 1.796, 12: 1.782, 13: 1.771, 14: 1.761}  # fmt: skip


def repeat_interval(ratios: Sequence[float]) -> tuple[float, float, float] | None:
    """The geometric mean of per-repeat ratios and its 90% t interval (log scale); None under two repeats."""
    if len(ratios) < 2:
        return None
    logs = np.log(np.asarray(ratios, dtype=float))
    mean, sd = float(logs.mean()), float(logs.std(ddof=1))
    half = T95.get(len(logs) - 1, 1.75) * sd / np.sqrt(len(logs))
    return float(np.exp(mean)), float(np.exp(mean - half)), float(np.exp(mean + half))


def geometric_mean(values: Sequence[float]) -> float:
    return float(np.exp(np.log(np.asarray(values, dtype=float)).mean()))


def server_interval(per_server: Sequence[Sequence[float]]) -> tuple[float, float, float] | None:
    """The interval over servers: each server's geometric mean of its rounds' ratios taken as one sample
    (:func:`repeat_interval` of them), None under two servers. Two ``vllm serve`` of the same code can differ in
    the ratio itself (on this host by an SD of up to 4 %, :func:`server_spread`; ``docs/bench-serve-power.md``,
    rounds eleven and twelve), which no number of rounds on one server averages away: the server is the unit a
    verdict about kvdi, not about one server, can rest on."""
    return repeat_interval([geometric_mean(rounds) for rounds in per_server if rounds])


def server_spread(per_server: Sequence[Sequence[float]]) -> tuple[float, float] | None:
    """How much the log ratios spread between rounds of one server and from server to server (one-way random
    effects, the ANOVA estimate): the within-server SD pooled over servers of two rounds or more, and the
    between-server SD from the variance of the servers' means less what their rounds' noise explains (0 where that
    leaves nothing). None without two servers and a server of two rounds."""
    logs = [np.log(np.asarray(rounds, dtype=float)) for rounds in per_server if len(rounds)]
    df = sum(len(x) - 1 for x in logs)
    if len(logs) < 2 or df == 0:
        return None
    within = float(sum(((x - x.mean()) ** 2).sum() for x in logs)) / df
    means = np.array([x.mean() for x in logs])
    between = float(means.var(ddof=1)) - within * float(np.mean([1 / len(x) for x in logs]))
    return float(np.sqrt(within)), float(np.sqrt(max(between, 0.0)))


def run_document(lines: Iterable[str]) -> dict[str, Any] | None:
    """The ``bench_serve_switch`` run document among a results file's lines (its one-line JSON), None without one;
    ValueError when that line is not JSON (``switch_pool`` and ``bench_serve_slices`` read results files by it)."""
    return next((json.loads(x) for x in lines if x.startswith('{"benchmark": "bench_serve_switch"')), None)
