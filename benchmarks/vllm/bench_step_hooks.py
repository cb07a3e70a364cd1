"""kvdi's scheduler-side work per engine step with N running requests that decode (no transfer due), in-process.

Drives kvdi's :class:`~kvdi.integrations.vllm.scheduler_side.SchedulerSide` over its store scheduler half with
vLLM's own ``SchedulerOutput`` types: N requests prefill in one step, then every timed step decodes all of them
(one token each, a new block every ``block_size`` steps, as vLLM sends them). Per N it prints the microseconds of
``build_connector_meta`` per step (median of the repeats and their spread, the Ns alternated within each repeat),
the ratio to the smallest N, and the bytes of the envelope pickled to the workers; ``--profile`` prints cProfile's
top functions (cumulative) for the largest N. No engine, no store round trip: only what kvdi adds per step.

    PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/vllm/bench_step_hooks.py [--running 1 16 64 256]

Against another tree (before a change): ``PYTHONPATH=<that tree> .venv-vllm/bin/python <this file>`` (the
tree on the path supplies kvdi and tests.helpers).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pickle
import pstats
import statistics
import time
from typing import Any

PROMPT = 64  # tokens per prompt: 16 full blocks of 4


def _side() -> Any:
    from kvdi.integrations.vllm.fleet.events import SchedulerFleet
    from kvdi.integrations.vllm.fleet.stats import AdapterStats
    from kvdi.integrations.vllm.parallel import RankSlice
    from kvdi.integrations.vllm.pending import HeldSaves
    from kvdi.integrations.vllm.requests import RequestTracker
    from kvdi.integrations.vllm.scheduler_side import SchedulerSide
    from tests.helpers.store import DictStore, Engine, make_settings, small_layout

    layout = small_layout(block_size=4)
    half = Engine(DictStore(), layout, make_settings()).scheduler
    tracker = RequestTracker()
    fleet = SchedulerFleet(half, layout, RankSlice(), tracker, events_on=False)
    return SchedulerSide(half, tracker, fleet, HeldSaves(best_effort=True), AdapterStats())


def _output(new: list[Any], cached: Any, scheduled: dict[str, int]) -> Any:
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


class Run:
    """One scheduler side with ``n`` running requests, and its decode steps."""

    def __init__(self, n: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.core.sched.output import NewRequestData
        from vllm.v1.request import Request

        self.side, self.n, self.step = _side(), n, 0
        self.ids = [f"r{i}" for i in range(n)]
        news = []
        for i, rid in enumerate(self.ids):
            request = Request(rid, list(range(i, i + PROMPT)), SamplingParams(max_tokens=4), None)
            self.side.get_num_new_matched_tokens(request, 0)
            self.side.update_state_after_alloc(request, None, 0)
            news.append(NewRequestData.from_request(request, (list(range(17 * i, 17 * i + 17)),)))
        self.side.build_connector_meta(_output(news, self._cached(None), dict.fromkeys(self.ids, PROMPT)))
        self.next_block = 17 * n

    def _cached(self, new_blocks: list[Any] | None) -> Any:
        from vllm.v1.core.sched.output import CachedRequestData

        if new_blocks is None:
            return CachedRequestData.make_empty()
        return CachedRequestData(
            req_ids=self.ids,
            resumed_req_ids=set(),
            new_token_ids=[[] for _ in self.ids],
            all_token_ids={},
            new_block_ids=new_blocks,
            num_computed_tokens=[PROMPT + self.step] * self.n,
            num_output_tokens=[self.step + 1] * self.n,
        )

    def outputs(self, steps: int) -> list[Any]:
        """The next ``steps`` decode steps' outputs (built before timing)."""
        out = []
        for _ in range(steps):
            self.step += 1
            grow = self.step % 4 == 0
            blocks: list[Any] = [None] * self.n
            if grow:
                blocks = [([self.next_block + i],) for i in range(self.n)]
                self.next_block += self.n
            out.append(_output([], self._cached(blocks), dict.fromkeys(self.ids, 1)))
        return out

    def timed(self, steps: int) -> tuple[float, int]:
        """Microseconds per step of ``build_connector_meta``, and the last envelope's pickled bytes."""
        outputs = self.outputs(steps)
        build = self.side.build_connector_meta
        gc.collect()
        gc.disable()  # a collection over the prepared outputs is no cost of kvdi's
        try:
            start = time.perf_counter()
            for output in outputs:
                meta = build(output)
            per_step = (time.perf_counter() - start) / steps * 1e6
        finally:
            gc.enable()
        return per_step, len(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    runs = {n: Run(n) for n in args.running}
    times: dict[int, list[float]] = {n: [] for n in args.running}
    sizes: dict[int, int] = {}
    for _ in range(args.repeats):
        for n, run in runs.items():  # alternated within each repeat
            us, size = run.timed(args.steps)
            times[n].append(us)
            sizes[n] = size
    base = statistics.median(times[args.running[0]])
    print(f"{'running':>8} {'us/step':>9} {'spread':>17} {'x smallest':>10} {'envelope B':>10}")
    for n in args.running:
        med = statistics.median(times[n])
        spread = f"{min(times[n]):.1f}-{max(times[n]):.1f}"
        print(f"{n:>8} {med:>9.1f} {spread:>17} {med / base:>10.2f} {sizes[n]:>10}")
    if args.profile:
        run = runs[args.running[-1]]
        outputs = run.outputs(args.steps)
        profile = cProfile.Profile()
        profile.enable()
        for output in outputs:
            run.side.build_connector_meta(output)
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(12)


if __name__ == "__main__":
    main()
