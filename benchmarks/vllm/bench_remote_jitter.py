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
hit's bytes against recomputing the hit). Printed: the share of rows whose lookups would be skipped and whose hits
refused. The budgets are a quiet machine's (``--prefill`` tokens/s, a 512-token prompt, a 480-token hit of
``--hit-bytes`` at ``--throughput``, about the bench's quiet run): there the jittered store's median round trip
(11.7 ms) passes both tests, so a skip or a refusal comes from the estimate, not from the store's usual speed.
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


def replay(args: argparse.Namespace, previous: bool) -> tuple[float, float]:
    """The share of replayed rows whose lookups are skipped, and whose hits are refused."""
    rnd = random.Random(args.seed)

    def rtt() -> float:
        draw = [40.0 if rnd.random() < 0.1 else rnd.uniform(1.0, 9.0) for _ in range(2)]
        return (sum(draw) + 0.7) / 1e3

    recompute = args.tokens / args.prefill
    transfer = args.hit_bytes / args.throughput
    hit_recompute = (args.tokens - 32) / args.prefill
    est: PreviousRoundTrip | RoundTrips = PreviousRoundTrip() if previous else RoundTrips()
    skipped = refused = 0
    for _ in range(args.rows):
        if isinstance(est, PreviousRoundTrip):
            est.add(rtt(), replace=True)
        else:
            for _ in range(SHIFT_SAMPLES):
                est.add(rtt())
                if not est.unsettled:
                    break
        value = est.value or 0.0
        skipped += 2 * value + transfer > recompute
        value = est.add(rtt())
        refused += value + transfer > hit_recompute
    return skipped / args.rows, refused / args.rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=20_000, help="rows replayed")
    p.add_argument("--prefill", type=float, default=15_000.0, help="the engine's prefill rate, tokens/s")
    p.add_argument("--tokens", type=int, default=512, help="prompt tokens (a hit: all but the last block of 32)")
    p.add_argument("--hit-bytes", type=float, default=983_040.0, help="the hit's bytes (15 blocks)")
    p.add_argument("--throughput", type=float, default=150e6, help="the store's load throughput, bytes/s")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    for name, previous in (("previous (EWMA, a rise weighed 0.6, probes replace)", True), ("median", False)):
        skipped, refused = replay(args, previous)
        print(f"{name}: lookups skipped in {skipped:.0%} of rows, hits refused in {refused:.0%}")


if __name__ == "__main__":
    main()
