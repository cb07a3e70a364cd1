"""Benchmark: kvdi's connectors inside a real vLLM, next to no connector and vLLM's ExampleConnector.

Usage (the vLLM venv, from the repository root)::

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_vllm [--repeats 5] [--out r.json]
    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_vllm --quick   # smoke run, ~3 min

Prints one JSON document on stdout (also written to ``--out``) and a human table on stderr
with every figure and every ratio of the brief's bars for a connector inside vLLM next to its target, met or not.

Configurations: no connector, kvdi ``null``, vLLM ``ExampleConnector``, kvdi
``shared_storage``, ``cpu_offload`` and ``redis`` (a real ``redis-server`` on a free loopback
port), each with vLLM's prefix caching on and off; every engine, the no-connector one too,
runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` and the engine core in-process. One engine
process per (configuration, repeat) runs these phases in order (``bench_engine.py``), on
random token-id prompts shared by all configurations (fresh sets per repeat):

- ``warmup``: fresh prompts, in no figure (the engine's first passes pay one-time costs);
- ``b_load``: the prompts the previous repeat's engine of the same configuration stored (a
  second engine loading what a first stored; repeat 0 has nothing to load and is left out of
  b figures), then ``b_hit``: the same prompts again (vLLM's prefix cache now holds them);
- ``a_1``, ``a_2``..: ``--a-rounds`` rounds of fresh prompts (no reuse; for a store connector
  each is a storing round; ``a_1``'s prompts are the ones the next repeat's engine loads);
- ``c_1..c_3``: ``a_1``'s prompts again (same engine over rounds: vLLM's local hits with
  prefix caching on, the connector's loads with it off);
- ``reset_load``: vLLM's prefix cache dropped (``reset_prefix_cache``, the connector keeps its
  store), ``a_1``'s prompts again: the loading round of a process-local store (``cpu_offload``);
- ``d_1..d_3``: a shared system prompt with distinct suffixes per request and per round;
- ``e_load``: prefix cache dropped, running requests decode while ``a_2``'s prompts arrive one
  every few steps and load; ``e_noload``: the same with fresh running requests and arrivals
  that vLLM's prefix cache now holds. The figure is the running requests' median
  inter-token latency while the arrivals are in flight.

Engines run alternately (every configuration once per repeat, the order rotated per repeat).
Ratios pair each engine with its baseline engine of the same repeat: median [min-max].
Greedy tokens must be identical across all engines for the same prompt (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.vllm.bench_report import figures, markdown, ratio_rows, table
from tests.real_vllm.vllm_support import IN_PROCESS, VOCAB, kv_config, make_prompts, make_tiny_llama, read_stats

ROOT = Path(__file__).resolve().parents[2]
BENCH_ENGINE = "benchmarks.vllm.bench_engine"
ENV = {**IN_PROCESS, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
CONNECTORS = ("no-connector", "kvdi-null", "vllm-example", "kvdi-shared_storage", "kvdi-cpu_offload", "kvdi-redis")
# Variants, not in the default run: ``-syncsave`` (KVDI_TRANSFER__ASYNC_SAVE=false) and ``-syncload``
# (KVDI_TRANSFER__ASYNC_LOAD=off), to tell the asynchronous paths' share apart; ``-canonical``
# (KVDI_SHARED_STORAGE__FORMAT=canonical, default grid: a section a KV head, docs/stored-format.md), to
# show the canonical format's ratios beside the per-rank format's.
EXTRA = (
    "kvdi-shared_storage-syncsave",
    "kvdi-redis-syncload",
    "kvdi-shared_storage-asyncload",
    "kvdi-shared_storage-canonical",
)
VARIANTS: dict[str, dict[str, Any]] = {
    "-syncsave": {"transfer__async_save": False},
    "-syncload": {"transfer__async_load": "off"},
    "-asyncload": {"transfer__async_load": "on"},
    "-canonical": {"shared_storage__format": "canonical"},
}
PROCESS_LOCAL = {"kvdi-cpu_offload"}  # its store lives in the engine's process: no second engine can load it


def kv_for(name: str, pc: str, work: Path, redis_url: str, stats: Path) -> dict[str, Any] | None:
    """KVTransferConfig kwargs of configuration ``name``; stores are per (configuration, prefix-caching setting)."""
    store = work / f"store-{name}-pc-{pc}"
    if name == "no-connector":
        return None
    if name == "vllm-example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        }
    connector = name.removeprefix("kvdi-")
    extra: dict[str, Any] = {}
    for suffix, settings in VARIANTS.items():
        if connector.endswith(suffix):
            connector, extra = connector.removesuffix(suffix), dict(settings)
    if connector == "shared_storage":
        extra["shared_storage__path"] = str(store)
    elif connector == "redis":
        extra.update(redis__url=redis_url, redis__key_prefix=f"bench-{name}-pc-{pc}:")
    return kv_config(connector, stats_dir=stats, **extra)


def prompt_sets(args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt of the run, by repeat (fresh per repeat, the same for every configuration)."""
    n, t = args.prompts, args.tokens
    sets: dict[str, Any] = {}
    for r in range(-1, args.repeats):
        sets[f"S{r}"] = make_prompts(n, t, seed=1000 + r)
        sets[f"A{r}"] = [make_prompts(n, t, seed=2000 + 10 * r + k) for k in range(args.a_rounds - 1)]
        sets[f"W{r}"] = make_prompts(n, t, seed=6000 + r)
        system = make_prompts(1, args.system_tokens, seed=3000 + r)[0]
        sets[f"D{r}"] = [
            [system + s for s in make_prompts(n, t - args.system_tokens, seed=4000 + 10 * r + k)] for k in range(3)
        ]
        sets[f"M{r}"] = [make_prompts(args.running, args.running_tokens, seed=5000 + 10 * r + k) for k in range(2)]
    return sets


def phases(args: argparse.Namespace, sets: dict[str, Any], r: int) -> list[dict[str, Any]]:
    """The phases of repeat ``r``'s engine (see the module docstring)."""
    mt = args.max_tokens

    def rnd(name: str, prompts: list[list[int]], reset: bool = False) -> dict[str, Any]:
        return {"kind": "round", "name": name, "prompts": prompts, "max_tokens": mt, "reset": reset}

    def mix(name: str, running: list[list[int]], reset: bool) -> dict[str, Any]:
        return {
            "kind": "mix",
            "name": name,
            "running": running,
            "running_max_tokens": args.running_max_tokens,
            "arrivals": sets[f"A{r}"][0][: args.arrivals],
            "arrival_max_tokens": mt,
            "every": args.every,
            "reset": reset,
        }

    # The engine's first forward passes pay one-time costs (kernels for new shapes): not in any figure.
    out = [rnd("warmup", sets[f"W{r}"])]
    out += [rnd("b_load", sets[f"S{r - 1}"]), rnd("b_hit", sets[f"S{r - 1}"])]
    out += [rnd("a_1", sets[f"S{r}"])] + [rnd(f"a_{k + 2}", a) for k, a in enumerate(sets[f"A{r}"])]
    out += [rnd(f"c_{k}", sets[f"S{r}"]) for k in range(1, args.c_rounds + 1)]
    out += [rnd("reset_load", sets[f"S{r}"], reset=True)]
    out += [rnd(f"d_{k + 1}", d) for k, d in enumerate(sets[f"D{r}"])]
    out += [mix("e_load", sets[f"M{r}"][0], True), mix("e_noload", sets[f"M{r}"][1], False)]
    return out


def run_engine(work: Path, name: str, spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the bench engine with ``spec`` in a fresh interpreter (``ENV``, then ``env`` over it); ``{"failed": ...}``
    with the log tail if it fails."""
    spec = {**spec, "out": str(work / f"{name}.out.json")}
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log = work / f"{name}.log"
    with log.open("w") as fh:
        rc = subprocess.run(
            [sys.executable, "-m", BENCH_ENGINE, str(spec_path)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV, **(env or {}), "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            timeout=1800,
            check=False,
        ).returncode
    if rc != 0 or not Path(spec["out"]).exists():
        text = log.read_text(errors="replace")
        phase = [line for line in text.splitlines() if line.startswith("[bench_engine] phase")][-1:]
        return {"failed": f"rc={rc}, during {phase}", "log": str(log), "log_tail": text[-4000:]}
    result: dict[str, Any] = json.loads(Path(spec["out"]).read_text())
    return result


def check_tokens(engines: dict[str, list[dict[str, Any]]], specs: dict[str, dict[str, Any]]) -> int:
    """Number of (engine, request) whose greedy tokens differ from another engine's for the same prompt."""
    seen: dict[tuple[tuple[int, ...], int], list[int]] = {}
    mismatches = 0
    for key, runs in engines.items():
        for e in runs:
            for spec_phase in specs[f"{key}#{e['repeat']}"]["phases"]:
                got = e["phases"][spec_phase["name"]]["tokens"]
                prompts = (
                    spec_phase["prompts"]
                    if spec_phase["kind"] == "round"
                    else (spec_phase["running"] + spec_phase["arrivals"])
                )
                for p, toks in zip(prompts, got, strict=True):
                    ref = seen.setdefault((tuple(p), len(toks)), toks)
                    mismatches += ref != toks
    return mismatches


def bench(args: argparse.Namespace, work: Path, redis_url: str) -> dict[str, Any]:
    """Run every engine under ``work``; return the JSON document."""
    model = make_tiny_llama(work / "model", layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=4)
    sets = prompt_sets(args)
    configs = [(c, pc) for c in args.configs for pc in args.prefix_caching]
    engines: dict[str, list[dict[str, Any]]] = {f"{c}/pc-{pc}": [] for c, pc in configs}
    specs: dict[str, dict[str, Any]] = {}
    loads: list[float] = []
    failures: list[dict[str, Any]] = []
    started = time.time()
    done = 0
    for r in range(args.repeats):
        if out_of_time(started, done, args.max_minutes):
            break
        done += 1
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for c, pc in order:
            key = f"{c}/pc-{pc}"
            stats = work / f"stats-{c}-pc-{pc}-{r}"
            spec = {
                "model": str(model),
                "prefix_caching": pc == "on",
                "block_size": args.block_size,
                "max_model_len": args.tokens + 64 + args.block_size,
                "max_num_batched_tokens": args.prompts * args.tokens + args.block_size,
                "kv": kv_for(c, pc, work, redis_url, stats),
                "phase_timeout_s": args.phase_timeout,
                "phases": phases(args, sets, r),
            }
            specs[f"{key}#{r}"] = spec
            t0 = time.perf_counter()
            res = run_engine(work, f"{c}-pc-{pc}-{r}", spec)
            loads.append(os.getloadavg()[0])
            if "failed" in res:
                failures.append({"engine": f"{key}#{r}", **res})
                print(f"[bench] repeat {r} {key}: FAILED {res['failed']} (log {res['log']})", file=sys.stderr)
                continue
            entry = {"repeat": r, "init_s": res["init_s"], "engine_s": time.perf_counter() - t0}
            entry["phases"] = {p["name"]: p for p in res["phases"]}
            entry["resets_ok"] = all(p["reset_ok"] is not False for p in res["phases"])
            if c.startswith("kvdi-"):
                entry["kvdi_worker_counters"] = read_stats(stats, "worker")
            engines[key].append(entry)
            print(f"[bench] repeat {r} {key}: engine {entry['engine_s']:.1f}s load {loads[-1]:.2f}", file=sys.stderr)
    names = [p["name"] for p in phases(args, sets, 0)]
    mismatches = check_tokens(engines, specs)
    for runs in engines.values():  # checked above; the JSON keeps timings, not token ids
        for e in runs:
            for p in e["phases"].values():
                p.pop("tokens", None)
    return {
        "setup": {
            "command": " ".join(["-m benchmarks.vllm.bench_vllm", *sys.argv[1:]]),
            "repeats": done,
            "repeats_asked": args.repeats,
            "prompts_per_round": args.prompts,
            "prompt_tokens": args.tokens,
            "system_prompt_tokens": args.system_tokens,
            **engine_setup(args),
            "a_rounds": args.a_rounds,
            "c_rounds": args.c_rounds,
            "vllm": "vllm-cpu 0.32.0, enforce_eager, engine core in-process, VLLM_CPU_NUM_OF_RESERVED_CPU=1, "
            "VLLM_CPU_KVCACHE_SPACE=1",
            "cpus": os.cpu_count(),
            "load_average_1min_after_each_engine": {
                "median": sorted(loads)[len(loads) // 2],
                "min": min(loads),
                "max": max(loads),
            },
            "wall_s": time.time() - started,
        },
        "ratios": ratio_rows(engines, PROCESS_LOCAL),
        "figures": figures(engines, names),
        "failures": failures,
        "tokens_identical": mismatches == 0,
        "token_mismatches": mismatches,
        "engines": engines,
    }


def out_of_time(started: float, done: int, max_minutes: float) -> bool:
    """Whether one more repeat (as long as the mean one so far) would end past ``max_minutes`` (said when so)."""
    per_repeat = (time.time() - started) / max(done, 1)
    if done and time.time() - started + per_repeat > max_minutes * 60:
        print(f"[bench] stopping after {done} repeats: --max-minutes {max_minutes}", file=sys.stderr)
        return True
    return False


def engine_setup(args: argparse.Namespace) -> dict[str, Any]:
    """The part of a result's ``setup`` that :func:`add_engine_args`' options make: workload and model."""
    mix = {
        "running": args.running,
        "running_tokens": args.running_tokens,
        "running_max_tokens": args.running_max_tokens,
    }
    return {
        "max_tokens": args.max_tokens,
        "mix": {**mix, "arrivals": args.arrivals, "every_steps": args.every},
        "block_size": args.block_size,
        "model": {
            **{"layers": args.layers, "hidden": args.hidden, "heads": args.heads},
            **{"kv_heads": 4, "dtype": "float32", "vocab": VOCAB},
        },
    }


def add_engine_args(p: argparse.ArgumentParser, max_minutes: float) -> None:
    """The options every vLLM benchmark here shares: the mix workload, the tiny model, limits, outputs."""
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--running", type=int, default=4, help="mix: running requests")
    p.add_argument("--running-tokens", type=int, default=256)
    p.add_argument("--running-max-tokens", type=int, default=48)
    p.add_argument("--arrivals", type=int, default=4, help="mix: arriving requests that load their prefix")
    p.add_argument("--every", type=int, default=2, help="mix: steps between arrivals")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--phase-timeout", type=float, default=120.0, help="an engine stuck this long in one phase fails")
    p.add_argument("--max-minutes", type=float, default=max_minutes, help="start no repeat that would end past this")
    p.add_argument("--work", type=Path, default=None, help="keep engines' specs, logs and stores here")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 2 repeats of no connector, shared_storage, example; pc on"
    )
    p.add_argument("--repeats", type=int, default=5, help="engines per configuration (default 5)")
    p.add_argument("--configs", nargs="+", choices=CONNECTORS + EXTRA, default=None, help="default: all but -syncsave")
    p.add_argument("--prefix-caching", nargs="+", choices=("on", "off"), default=None, help="default: on off")
    p.add_argument("--prompts", type=int, default=6, help="requests per round")
    p.add_argument("--tokens", type=int, default=768, help="prompt tokens")
    p.add_argument("--system-tokens", type=int, default=512, help="shared system prompt of workload d")
    p.add_argument("--a-rounds", type=int, default=3, help="fresh rounds (at least 2)")
    p.add_argument("--c-rounds", type=int, default=3)
    add_engine_args(p, max_minutes=40.0)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = min(args.repeats, 2)
        args.configs = args.configs or ["no-connector", "kvdi-shared_storage", "vllm-example"]
        args.prefix_caching = args.prefix_caching or ["on"]
    args.configs = args.configs or list(CONNECTORS)
    args.prefix_caching = args.prefix_caching or ["on", "off"]
    if args.a_rounds < 2:
        p.error("--a-rounds must be at least 2 (the storing round, then no-reuse rounds)")
    if args.arrivals > args.prompts:
        p.error("--arrivals must be at most --prompts")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from kvdi.testing.redis_server import RedisServer

    with tempfile.TemporaryDirectory(prefix="kvdi-bench-vllm-") as tmp, RedisServer() as server:
        doc = bench(args, args.work or Path(tmp), server.url)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")  # compact: it may be committed
    print(table(doc), file=sys.stderr)
    print("\n" + markdown(doc), file=sys.stderr)
    print(
        f"tokens identical: {doc['tokens_identical']} ({doc['token_mismatches']} mismatches); "
        f"load average {doc['setup']['load_average_1min_after_each_engine']}",
        file=sys.stderr,
    )
    for f in doc["failures"]:
        print(f"FAILED engine {f['engine']}: {f['failed']} (log {f['log']})", file=sys.stderr)
    return 0 if doc["tokens_identical"] and not doc["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
