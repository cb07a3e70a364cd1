"""Every connector hook vLLM calls per engine step, counted and timed, kvdi against the do-nothing connector.

Builds both roles of a connector in this process the way vLLM does (``cls(vllm_config, role, kv_cache_config)``
with a real ``VllmConfig`` of a tiny random Llama), then drives decode steps of ``--running`` requests in the
order of vLLM 0.32's scheduler and model runner (``build_connector_meta``; the worker's ``bind_connector_metadata``,
``start_load_kv``, per layer ``wait_for_layer_load`` and ``save_kv_layer``, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``,
``get_kv_connector_kv_cache_events``, ``build_connector_worker_meta``, ``clear_connector_metadata``; the
scheduler's ``update_connector_output``, ``get_kv_connector_stats``, ``take_events``, ``has_pending_push_work``)
and the pickling of the metadata envelope to the workers. Steps move nothing (the prompts ran before timing).

Per hook it prints, for each connector, the Python function calls per step (counted with ``sys.setprofile``: the
same on any machine, loaded or quiet) and the microseconds per step (median of ``--repeats`` alternated repeats,
with their spread), and kvdi's excess over the do-nothing connector. It also lists the threads each connector
leaves running. Run it against another tree (before a change) with ``PYTHONPATH=<that tree>``:

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_hook_costs [--configs noop null] [--running 4]

With ``redis`` among the configs it starts a throwaway ``redis-server`` on a loopback port (``KVDI_REDIS__URL``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.real_vllm.hook_support import (
    LAYERS,
    SCHEDULER_HOOKS,
    WORKER_HOOKS,
    Pair,
    pickle_envelope,
    run_steps,
    unpickle_envelope,
)


class Recorder:
    """Wraps the hooks of a :class:`Pair` (and the envelope's pickling) with per-hook time and call counters."""

    def __init__(self, pair: Pair) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.counting = False
        self._depth = 0
        self._current = ""
        for role, obj, hooks in (("sched", pair.scheduler, SCHEDULER_HOOKS), ("worker", pair.worker, WORKER_HOOKS)):
            for hook in hooks:
                setattr(obj, hook, self._wrap(f"{role}.{hook}", getattr(obj, hook)))
        pair.pickle = self._wrap("sched.pickle envelope", pickle_envelope)
        pair.unpickle = self._wrap("worker.unpickle envelope", unpickle_envelope)

    def _wrap(self, label: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self._current = label
                sys.setprofile(self._count)
                try:
                    return inner(*args, **kwargs)
                finally:
                    sys.setprofile(None)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        return timed

    def _count(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.calls[self._current] = self.calls.get(self._current, 0) + 1


def measure(pairs: dict[str, Pair], steps: int, repeats: int) -> tuple[dict[str, dict[str, list[float]]], dict]:
    """Per connector, per hook: microseconds per step of each repeat, and Python calls per step."""
    recorders = {name: Recorder(pair) for name, pair in pairs.items()}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in pairs}
    for name, pair in pairs.items():  # counted once: deterministic
        rec = recorders[name]
        rec.counting = True
        run_steps(pair, steps)
        rec.counting = False
        rec.calls = {k: v / steps for k, v in rec.calls.items()}
    for _ in range(repeats):
        for name, pair in pairs.items():  # alternated within each repeat
            rec = recorders[name]
            rec.seconds = {}
            run_steps(pair, steps)
            for label, s in rec.seconds.items():
                times[name].setdefault(label, []).append(s / steps * 1e6)
    return times, {name: rec.calls for name, rec in recorders.items()}


def report(times: dict[str, dict[str, list[float]]], calls: dict[str, dict[str, float]], base: str) -> None:
    names = list(times)
    labels = sorted({label for t in times.values() for label in t}, key=lambda s: (not s.startswith("sched"), s))
    head = "".join(f" {n + ' calls':>14} {n + ' us':>14} {'spread':>11}" for n in names)
    print(f"{'hook (per step)':<42}{head}" + "".join(f" {n + ' - ' + base:>16}" for n in names if n != base))
    totals = {n: [0.0] * len(next(iter(times[n].values()))) for n in names}
    for label in labels:
        row = f"{label:<42}"
        med: dict[str, float] = {}
        for n in names:
            series = times[n].get(label, [0.0])
            med[n] = statistics.median(series)
            for i, v in enumerate(series):
                if len(series) == len(totals[n]):
                    totals[n][i] += v
            row += f" {calls[n].get(label, 0):>14.1f} {med[n]:>14.2f} {min(series):>5.1f}-{max(series):<5.1f}"
        row += "".join(f" {med[n] - med[base]:>16.2f}" for n in names if n != base)
        print(row)
    row = f"{'total':<42}"
    for n in names:
        c = sum(calls[n].values())
        row += f" {c:>14.1f} {statistics.median(totals[n]):>14.2f} {min(totals[n]):>5.1f}-{max(totals[n]):<5.1f}"
    print(row + "".join(f" {statistics.median(totals[n]) - statistics.median(totals[base]):>16.2f}"
                        for n in names if n != base))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["noop", "null"])
    parser.add_argument("--running", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tests.real_vllm.vllm_support import make_tiny_llama

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        if "redis" in args.configs:
            from kvdi.testing.redis_server import RedisServer

            os.environ["KVDI_REDIS__URL"] = stack.enter_context(RedisServer()).url
        model = make_tiny_llama(work / "model")
        pairs = {name: Pair(name, model, args.running, work) for name in args.configs}
        time.sleep(0.5)
        for name, pair in pairs.items():
            alive = sorted(t.name for t in threading.enumerate() if t.name in pair.threads and t.is_alive())
            print(f"{name}: threads started by its two roles: {alive or 'none'}")
        times, calls = measure(pairs, args.steps, args.repeats)
        print(f"\n{args.running} running requests decoding, {args.steps} steps x {args.repeats} repeats; "
              f"{len(LAYERS)} layers (per-layer hooks summed)")  # fmt: skip
        report(times, calls, args.configs[0])


if __name__ == "__main__":
    main()
