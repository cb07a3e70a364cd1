"""How often the load deadline's round-trip estimate turns a jittered store into a slow one: the ``5j`` row of
``bench_remote.py --rows`` replayed without an engine, deterministic (seeded), for the previous estimate and today's.

Usage (from the repository root; no vLLM needed)::

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.vllm.bench_remote_jitter [--rows 20000] [--prefill 15000]

Each round trip is two draws of the row's proxy delay (1-9 ms uniformly, or 40 ms one time in ten, each way) and
0.7 ms of Redis and loopback (what a 0 ms probe measures). Each replayed row is what a scheduler half sees in the
bench: the idle prober's probe during the row's settle (the previous estimate took its round trip whole; today's
folds it in and asks again while it is far off: :meth:`~kvdi.connectors.store.deadline.DeadlineRule.probe`), then
the row's lookup decision (``skip_lookup``: 2 round trips and the whole hit's bytes against recomputing the prompt),
then the step's batched lookup answers (a sample) and its hit is offered or not (``offer``: a round trip and the
hit's bytes against recomputing the hit). Printed: the share of rows whose lookups would be skipped, whose hits
refused, and whose lookup ran past its deadline (recomputed after waiting for it). The budgets default to a quiet
machine's (``--prefill`` tokens/s, a 512-token prompt, a 480-token hit of ``--hit-bytes`` at ``--throughput``,
about the bench's quiet run): there the jittered store's median round trip (11.7 ms) passes both tests, so a skip
or a refusal comes from the estimate, not from the store's usual speed; the deadline is then the budget (33 ms),
shorter than the store's outliers whatever the estimate. ``--prefill 5000`` is a loaded machine's: the budget
(100 ms) outlasts the outliers, and only a deadline of 4x the median (43 ms) cuts them short.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from collections.abc import Callable
from typing import cast

from kvdi.connectors.store.deadline import MIN_DEADLINE_S, OUTLIER, DeadlineRule, DeadlineStats
from kvdi.connectors.store.deadline_estimates import SHIFT_SAMPLES, THROUGHPUT_BOUNDS, Ewma, RoundTrips
from kvdi.connectors.store.protocol import BlockStore


class PreviousRoundTrip:
    """The estimate before: an average weighing a rise 0.6 and a fall 0.2, which a probe replaced."""

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, sample: float, replace: bool = False) -> float:
        v = self.value
        self.value = sample if v is None or replace else v + (0.6 if sample > v else 0.2) * (sample - v)
        return self.value


def replay(args: argparse.Namespace, previous: bool, median_deadline: bool = False) -> tuple[float, float, float]:
    """The share of replayed rows whose lookups are skipped, whose hits are refused, and whose lookup (made) ran past
    its deadline (``median_deadline``: 4x the median, as this change had it first, instead of 4x the tail)."""
    rnd = random.Random(args.seed)

    def rtt() -> float:
        draw = [40.0 if rnd.random() < 0.1 else rnd.uniform(1.0, 9.0) for _ in range(2)]
        return (sum(draw) + 0.7) / 1e3

    recompute = args.tokens / args.prefill
    transfer = args.hit_bytes / args.throughput
    hit_recompute = (args.tokens - 32) / args.prefill
    est: PreviousRoundTrip | RoundTrips = PreviousRoundTrip() if previous else RoundTrips()
    skipped = refused = overran = 0
    for _ in range(args.rows):
        if isinstance(est, PreviousRoundTrip):
            est.add(rtt(), replace=True)
        else:
            for _ in range(SHIFT_SAMPLES):
                est.add(rtt())
                if not est.unsettled:
                    break
        value = est.value or 0.0
        skip = 2 * value + transfer > recompute
        skipped += skip
        tail = value if isinstance(est, PreviousRoundTrip) or median_deadline else (est.tail or 0.0)
        deadline = max(min(recompute, 4 * tail), 0.02)
        sample = rtt()
        overran += not skip and sample > deadline
        value = est.add(sample)
        refused += value + transfer > hit_recompute
    return skipped / args.rows, refused / args.rows, overran / args.rows


def _jittered(rnd: random.Random) -> float:
    """One round trip of the ``5j`` row: two draws of the proxy's delay and 0.7 ms of Redis and loopback."""
    draw = [40.0 if rnd.random() < 0.1 else rnd.uniform(1.0, 9.0) for _ in range(2)]
    return (sum(draw) + 0.7) / 1e3


def replay_prefetches(args: argparse.Namespace, previous: bool) -> tuple[float, float, float]:
    """The ``5j`` row's prefetches replayed through the deadline (``previous``: the rule before the store's slow end:
    the budget, or 4x the second slowest of the last 9 round trips plus the bytes at an average throughput; else
    today's :meth:`~kvdi.connectors.store.deadline.DeadlineRule.deadline_s`). Each replayed row: the step's batched
    lookup (a round trip sample), then a prefetch of the hit (a round trip and its bytes at ``--throughput``, reported
    at the next ``--step-ms``), abandoned past its deadline (the request waits that long, then recomputes the hit).
    The share of prefetches abandoned, and the median and the mean of a hit's cost as a ratio to recomputing it."""
    rnd = random.Random(args.seed)
    rule = DeadlineRule(cast(BlockStore, None), "replay", DeadlineStats(), enabled=True, clock=lambda: 0.0)
    rule.model.prefill.add(args.prefill)
    average = Ewma(*THROUGHPUT_BOUNDS)  # the previous rule's throughput
    hit_tokens = args.tokens - 32
    recompute = hit_tokens / args.prefill
    step = args.step_ms / 1e3
    abandoned, costs = 0, []
    for _ in range(args.rows):
        rule.answered(_jittered(rnd))
        if previous:
            rtt = rule.model.rtt
            tail = sorted(rtt.recent)[-2] if len(rtt.recent) >= 3 else max(rtt.recent)
            load = None if average.value is None else max(rtt.value or 0.0, tail) + args.hit_bytes / average.value
            deadline = max(recompute if load is None else min(recompute, OUTLIER * load), MIN_DEADLINE_S)
        else:
            deadline = rule.deadline_s(hit_tokens, int(args.hit_bytes))
        took = _jittered(rnd) + args.hit_bytes / args.throughput
        took = math.ceil(took / step) * step if step > 0 else took
        if took > deadline:
            abandoned += 1
            costs.append((deadline + recompute) / recompute)
            continue  # the next step's lookup answers the store: the replay does not keep it suspect
        costs.append(took / recompute)
        sample = args.hit_bytes / max(took - (rule.model.rtt.value or 0.0), took / 10)
        average.add(sample)
        rule.model.transfer(int(args.hit_bytes), took)
    return abandoned / args.rows, statistics.median(costs), statistics.fmean(costs)


def replay_rows(args: argparse.Namespace, previous: bool) -> float:
    """The rows of ``bench_remote.py --rows`` in their order, round after round, through the throughput estimate
    (``previous``: an average weighing a sample 0.2; else today's median, :class:`~.deadline_estimates.Rates`): each
    of a row's 4 prefetches is a sample (its round trip at the row's delay, jittered in ``5j``, and the hit's bytes at
    ``--throughput``, reported at the next ``--step-ms``, less the median round trip); the ``50`` row's lookups are
    skipped (no sample), the stall's prefetches abandoned (none). Before each ``0``, ``1`` and ``5`` row, its 4
    arrivals' lookup decisions in one step (the previous rule: the row's round trip, fresh from the prober, and the
    whole hit's load against recomputing each prompt alone; today's ``skip_lookup``: against the step the recompute
    joins). The share of those lookups skipped: at these delays loading beats recomputing (rule off: 0.3-0.5x), so
    every skip is the rule's."""
    rnd = random.Random(args.seed)
    rule = DeadlineRule(cast(BlockStore, None), "replay", DeadlineStats(), enabled=True, clock=lambda: 0.0)
    rule.model.prefill.add(args.prefill)
    rule._probe_at = 0.0  # the replay's clock stands still: no background probe
    average = Ewma(*THROUGHPUT_BOUNDS)
    step = args.step_ms / 1e3
    skipped = decisions = 0

    def fixed(delay_ms: float) -> Callable[[random.Random], float]:
        return lambda _: (2 * delay_ms + 0.7) / 1e3

    delays = {"0": fixed(0.0), "1": fixed(1.0), "5": fixed(5.0), "5j": _jittered}
    for _ in range(args.rows // 6):
        for row in ("0", "1", "5", "5j"):
            rtt = delays[row]
            rule.model.round_trip(statistics.median(rtt(rnd) for _ in range(9)), replace=True)
            for _ in range(4 if row != "5j" else 0):  # the row's arrivals, asked in one step
                decisions += 1
                if previous:
                    thr = average.value
                    load = None if thr is None else (rule.model.rtt.value or 0.0) + args.hit_bytes / thr
                    budget = rule.budget_s(args.tokens) or 0.0
                    skipped += (rule.model.rtt.value or 0.0) + (load or 0.0) > budget
                else:
                    skipped += rule.skip_lookup(args.tokens, int(args.hit_bytes))
            rule.step(0)
            for _ in range(4):
                took = rtt(rnd) + args.hit_bytes / args.throughput
                took = math.ceil(took / step) * step if step > 0 else took
                average.add(args.hit_bytes / max(took - (rule.model.rtt.value or 0.0), took / 10))
                rule.model.transfer(int(args.hit_bytes), took)
    return skipped / max(decisions, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=20_000, help="rows replayed")
    p.add_argument("--prefill", type=float, default=15_000.0, help="the engine's prefill rate, tokens/s")
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens (a hit: all but the last block of 32)")
    p.add_argument("--hit-bytes", type=float, default=983_040.0, help="the hit's bytes (15 blocks)")
    p.add_argument("--throughput", type=float, default=150e6, help="the store's load throughput, bytes/s")
    p.add_argument("--step-ms", type=float, default=0.0, help="a prefetch's report waits for the next step (0: none)")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    for name, previous in (("previous (each prompt alone, throughput an average)", True),
                           ("today (the step a recompute joins, throughput a median)", False)):  # fmt: skip
        print(f"rows 0, 1, 5 in the rows' order, {name}: lookups skipped {replay_rows(args, previous):.1%}")
    for name, previous in (("previous (abandoned at the budget)", True), ("today (the store's slow end)", False)):
        share, median, mean = replay_prefetches(args, previous)
        print(f"prefetch deadline, {name}: prefetches abandoned {share:.1%}, a hit's cost / recomputing it: "
              f"median {median:.2f}x, mean {mean:.2f}x")  # fmt: skip
    for name, previous, median_deadline in (
        ("previous (EWMA, a rise weighed 0.6, probes replace)", True, False),
        ("median, deadline 4x the median", False, True),
        ("median, deadline 4x the tail", False, False),
    ):
        skipped, refused, overran = replay(args, previous, median_deadline)
        print(f"{name}: lookups skipped in {skipped:.0%} of rows, hits refused in {refused:.0%}, "
              f"a lookup past its deadline in {overran:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
