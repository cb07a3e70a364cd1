"""Side by side: asynchronous loads in real vLLM with ``transfer.idle_load_wait_ms=0`` and with the default.

One in-process engine stores the prompts in ``shared_storage``; then fresh engines load them
with ``transfer.async_load=on``, alternating the two settings ``--repeats`` times. Printed per
setting: the loading round's seconds and the median engine steps per load (medians, min-max).
Engines run one at a time (slow to start on small machines).

    PYTHONPATH=$PWD VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/idle_load_wait.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.real_vllm.vllm_support import (  # noqa: E402
    IN_PROCESS,
    kv_config,
    make_prompts,
    make_tiny_llama,
    read_stats,
    run_engine,
)

DEFAULT_MS = 10.0


def steps_median(worker: dict[str, float]) -> float:
    names = {1: "load_steps_1", 2: "load_steps_2", 3: "load_steps_3", 4: "load_steps_4_or_more"}
    steps = [n for n, key in names.items() for _ in range(int(worker.get(key, 0)))]
    return float(statistics.median(steps)) if steps else float("nan")


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, choices=range(1, 21), metavar="1..20")
    parser.add_argument("--prompts", type=int, default=8, choices=range(1, 65), metavar="1..64")
    parser.add_argument("--wait-ms", type=float, default=DEFAULT_MS, help="the setting compared with 0 (0..1000)")
    args = parser.parse_args(argv)
    if not 0 < args.wait_ms <= 1000:
        parser.error(f"--wait-ms={args.wait_ms}: must be > 0 and at most 1000")
    wait_ms = args.wait_ms
    with tempfile.TemporaryDirectory(prefix="kvdi-idle-wait-") as tmp:
        work = Path(tmp)
        model = make_tiny_llama(work / "model")
        prompts = make_prompts(args.prompts, 200, seed=7)
        base: dict[str, Any] = {"model": str(model), "prompts": prompts, "max_tokens": 8, "block_size": 32}
        store = work / "store"
        producer = kv_config("shared_storage", shared_storage__path=str(store))
        run_engine(work, "store", {**base, "kv": producer}, IN_PROCESS)
        results: dict[float, dict[str, list[float]]] = {0.0: {"s": [], "steps": []}, wait_ms: {"s": [], "steps": []}}
        for rep in range(args.repeats):
            for ms in (0.0, wait_ms) if rep % 2 == 0 else (wait_ms, 0.0):
                stats = work / f"stats-{ms}-{rep}"
                kv = kv_config("shared_storage", stats_dir=stats, shared_storage__path=str(store))
                extra = kv["kv_connector_extra_config"]
                extra.update({"kvdi.transfer.async_load": "on", "kvdi.transfer.idle_load_wait_ms": ms})
                out = run_engine(work, f"load-{ms}-{rep}", {**base, "kv": kv}, IN_PROCESS)
                results[ms]["s"].append(out["rounds"][0]["seconds"])
                results[ms]["steps"].append(steps_median(read_stats(stats, "worker")))
        for ms, r in results.items():
            print(f"idle_load_wait_ms={ms:g}: loading round s {spread(r['s'])}; steps per load {spread(r['steps'])}")
        ratio = statistics.median(results[wait_ms]["s"]) / statistics.median(results[0.0]["s"])
        print(f"loading round, idle_load_wait_ms={wait_ms:g} / off: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
