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
import random

from kvdi.connectors.store.deadline_estimates import SHIFT_SAMPLES, RoundTrips


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=20_000, help="rows replayed")
    p.add_argument("--prefill", type=float, default=15_000.0, help="the engine's prefill rate, tokens/s")
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens (a hit: all but the last block of 32)")
    p.add_argument("--hit-bytes", type=float, default=983_040.0, help="the hit's bytes (15 blocks)")
    p.add_argument("--throughput", type=float, default=150e6, help="the store's load throughput, bytes/s")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
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
