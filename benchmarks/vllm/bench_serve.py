"""Benchmark: kvdi's cost per engine step under ``vllm serve``, measured with vLLM's own ``bench serve`` client.

Usage (the vLLM venv, from the repository root)::

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_serve [--repeats 2] [--out r.json]
    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_serve --full   # both datasets, c = 1, 4, 16

One ``vllm serve`` (the tiny random Llama of the real-vLLM tests with a word-level tokenizer, written with
``transformers`` at run time; block size 32, prefix caching on) per (configuration, repeat), configurations
alternated (one order, then the reverse, rotated every second repeat): no connector, :mod:`.noop_connector`
(a connector whose every method does nothing: vLLM's floor for "a connector is configured"), vLLM's
``ExampleConnector``, kvdi ``null``, ``shared_storage``, ``cpu_offload`` and ``redis`` (a real ``redis-server``
on loopback); with ``--before-tree`` each kvdi configuration also runs as ``<name>@before``, kvdi imported
from that checkout. Each server runs a warm-up, then per (dataset, concurrency) three passes of vLLM's client
(``vllm.benchmarks.serve``, the code of
``vllm bench serve``, unchanged, called in this process with arguments parsed by its own parser):

- ``cold``: prompts the server has never seen (a store connector stores them);
- ``hit``: the same prompts again: vLLM's own prefix cache holds every prefix (kvdi must be invisible);
- ``load``: vLLM's prefix cache reset (``POST /reset_prefix_cache``, the connector's store kept), the same
  prompts again: a store connector loads every prefix; the others recompute.

Per pass it also keeps every request's chunk gaps, vLLM's own engine-side inter-token histogram (log stats on, fine
buckets) and the engine's CPU time: the POOLED table (:mod:`.bench_serve_pooled`, why in :mod:`.bench_serve_stats`
and ``docs/bench-serve-power.md``) judges each row against issue 31's bars.

Prints, per row, TTFT and ITL median and p90 of each configuration as ratios to the do-nothing connector of the
same repeat (median of the repeats, [min-max]), and the do-nothing connector against no connector; the 1-minute
load average at every pass says how busy the machine was.

Every server runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (``--reserved-cpus``): vLLM-CPU reserves one more core
for "a connector's threads" whenever any connector is configured (``vllm/utils/ompmultiprocessing.py``); on a
2-core machine that exceeds the cores, so it reserves none and binds OpenMP to both, and every connector,
vLLM's own included, then runs beside spinning OpenMP threads while no connector does not. ``--reserved-cpus
-1`` keeps vLLM's default to show that cost. ``--multi-turn`` adds vLLM's multi-turn client
(:mod:`.bench_serve_multi_turn`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.vllm.bench_serve_pin import allow_all, pin_server
from benchmarks.vllm.bench_serve_pooled import engine_cpu_s
from benchmarks.vllm.bench_serve_report import table
from benchmarks.vllm.bench_serve_stats import (
    ITL_BUCKETS_S,
    TTFT_BUCKETS_S,
    cpu_delta,
    group_cpu_s,
    histogram_delta,
    histogram_quantiles,
    itl_histogram,
    per_request,
)
from benchmarks.vllm.vllm_cli import patch_version
from tests.real_vllm.serve_support import free_port, model_with_tokenizer
from tests.real_vllm.vllm_support import BLOCK_SIZE, kv_config, make_tiny_llama, read_stats

ROOT = Path(__file__).resolve().parents[2]
BEFORE = "@before"  # the same configuration with kvdi from --before-tree
CONFIGS = ("none", "noop", "noop2", "example", "null", "shared_storage", "cpu_offload", "redis")  # noop2: A/A twin
PASSES = ("cold", "hit", "load")
KVDI_CONFIGS = ("null", "shared_storage", "cpu_offload", "redis")
START_TIMEOUT_S = 600
NOOP = {"kv_connector": "NoopConnector", "kv_connector_module_path": "benchmarks.vllm.noop_connector"}


BASE_PRIORITY = os.getpriority(os.PRIO_PROCESS, 0)
CLIENT_PRIORITY = -10


def client_priority() -> str:
    """Raise this process's (the client's) scheduling priority, so that it reads every chunk when it arrives.

    The client mostly waits on sockets; on a busy machine a client scheduled late reads several chunks at once and
    vLLM's client then records inter-token gaps near 0 ms. Servers started from here go back to the base priority.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, 0, CLIENT_PRIORITY)
    except OSError as exc:
        return f"client priority unchanged ({exc})"
    return f"client at priority {CLIENT_PRIORITY}, servers at {BASE_PRIORITY}"


SERVER_PRIORITY = [BASE_PRIORITY]  # --server-priority: the servers' niceness (set before they start)
PIN = [False]  # --pin: each ready server's processes placed the same way (:mod:`.bench_serve_pin`)
ENGINE_ON_WORKER = [False]  # --engine-on-worker: with --pin, the engine core on the worker's cores


def server_priority() -> None:
    """The started server's niceness (``--server-priority``, the client's by default): a server at the base
    priority on a busy machine sent each request's tokens in one burst at its end (its API server scheduled late).
    Every core allowed again (``--pin`` may have pinned the client)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, SERVER_PRIORITY[0])
    allow_all()


def kv_for(name: str, store: Path, redis_url: str, stats: Path | None) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of configuration ``name`` (None: no connector); ``<name>@before`` is ``name``.
    ``stats``: kvdi's stats files (``kvdi_stats_dir``, opt-in) go there; None: off, as kvdi's default."""
    name = name.removesuffix(BEFORE)
    if name == "none":
        return None
    if name in ("noop", "noop2"):  # noop2: the same connector, a second name for an A/A run (the noise floor)
        return {**NOOP, "kv_role": "kv_both"}
    if name == "example":
        extra = {"shared_storage_path": str(store / "example")}
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    by_name: dict[str, dict[str, Any]] = {
        "null": {},
        "shared_storage": {"shared_storage__path": str(store / "kvdi")},
        "cpu_offload": {"cpu_offload__max_bytes": 512 << 20},
        "redis": {"redis__url": redis_url, "redis__key_prefix": f"bench-{store.name}:"},
    }
    return kv_config(name, stats_dir=stats, **by_name[name])


class Server:
    """One ``vllm serve`` process group on loopback (dev mode on, for ``/reset_prefix_cache``)."""

    def __init__(
        self, model: Path, log: Path, kv: dict[str, Any] | None, max_len: int, tree: Path = ROOT,
        reserved_cpus: int | None = None, extra: Sequence[str] = (), log_stats: bool = False,
    ) -> None:  # fmt: skip
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--dtype", "float32",
            "--max-model-len", str(max_len), "--block-size", str(BLOCK_SIZE), "--seed", "0",
            *extra,
        ]  # fmt: skip
        # log stats on: vLLM's inter-token histogram (engine-side timestamps), with buckets fine enough for quantiles
        buckets = json.dumps({"inter_token_latency": ITL_BUCKETS_S, "time_to_first_token": TTFT_BUCKETS_S})
        command += ["--custom-histogram-buckets", buckets] if log_stats else ["--disable-log-stats"]
        if kv is not None:
            command += ["--kv-transfer-config", json.dumps(kv)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
        if reserved_cpus is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), str(ROOT), env.get("PYTHONPATH", "")) if p)
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=server_priority,
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                if reply.status == 200:
                    if PIN[0]:
                        print(f"  {pin_server(os.getpgid(self.proc.pid), ENGINE_ON_WORKER[0])}", file=sys.stderr)
                    return
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve not ready after {START_TIMEOUT_S}s:\n{self.log_tail()}")

    def reset_prefix_cache(self) -> bool:
        """Drop vLLM's prefix cache (not the connector's store); retried while blocks are still held."""
        for _ in range(50):
            request = urllib.request.Request(f"{self.url}/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=30) as reply:
                if json.loads(reply.read() or b"{}").get("success", True):
                    return True
            time.sleep(0.2)
        return False

    def metrics_text(self) -> str:
        """The server's ``/metrics`` page now."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as reply:
            return str(reply.read().decode())

    def itl_histogram(self) -> dict[str, float]:
        """vLLM's inter-token histogram now (:func:`.bench_serve_stats.itl_histogram`; empty with log stats off)."""
        return itl_histogram(self.metrics_text())

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


def client_args(
    dataset: str, concurrency: int, prompts: int, seed: int, model: Path, url: str, output_len: int = 32
) -> list[str]:
    """``vllm bench serve`` arguments of one pass (vLLM's own flags); ``--save-detailed`` keeps each request's
    chunk gaps, TTFT and latency in the result (not written anywhere: no ``--save-result``)."""
    args = [
        "--backend", "vllm", "--base-url", url, "--model", str(model), "--dataset-name", dataset,
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90", "--ignore-eos",
        "--disable-tqdm", "--ready-check-timeout-sec", "0", "--save-detailed",
    ]  # fmt: skip
    if dataset == "prefix_repetition":
        args += [
            "--prefix-repetition-prefix-len", "768", "--prefix-repetition-suffix-len", "32",
            "--prefix-repetition-num-prefixes", str(max(1, prompts // 4)),
            "--prefix-repetition-output-len", str(output_len),
        ]  # fmt: skip
    else:
        args += ["--random-input-len", "512", "--random-output-len", str(output_len)]
    return args


def run_client(argv: list[str]) -> dict[str, Any]:
    """One run of vLLM's serving benchmark client; its result dict."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    with contextlib.redirect_stdout(sys.stderr):
        result: dict[str, Any] = bench_main(parser.parse_args(argv))
    return result


FIGURES = (
    "median_ttft_ms", "p90_ttft_ms", "median_itl_ms", "p90_itl_ms", "median_tpot_ms", "p90_tpot_ms",
    "median_e2el_ms", "p90_e2el_ms", "duration", "completed", "total_output_tokens",
)  # fmt: skip


def serve_one(
    name: str, repeat: int, rows: list[tuple[str, int]], args: argparse.Namespace, work: Path, redis_url: str
) -> dict[str, Any]:
    """Start ``name``'s server, run the warm-up and every row's passes, stop it; figures per row and pass."""
    store = work / f"store-{name}-{repeat}"
    stats = work / f"stats-{name}-{repeat}"
    kv = kv_for(name, store, redis_url, stats)
    tree = args.before_tree if name.endswith(BEFORE) else ROOT
    reserved = None if args.reserved_cpus < 0 else args.reserved_cpus
    log = work / f"serve-{name}-{repeat}.log"
    server = Server(args.model, log, kv, 2048, tree, reserved, log_stats=args.server_itl)
    out: dict[str, Any] = {"config": name, "repeat": repeat, "rows": {}}
    try:
        server.wait_ready()
        run_client(client_args("random", 4, 8, 10_000 + repeat, args.model, server.url))  # warm-up, no figure
        for i, (dataset, concurrency) in enumerate(rows):
            seed = 1000 * repeat + i  # the same prompts for every configuration of a repeat
            argv = client_args(dataset, concurrency, args.prompts, seed, args.model, server.url, args.output_len)
            row: dict[str, Any] = {}
            for phase in PASSES:
                if phase == "load" and not server.reset_prefix_cache():
                    print(f"  {name}: reset_prefix_cache refused; load pass left out", file=sys.stderr)
                    continue
                time.sleep(args.settle_s)  # background saves of the previous pass done
                load = os.getloadavg()[0]
                cpu_before, hist_before = group_cpu_s(server.proc.pid), server.itl_histogram()
                result = run_client(argv)
                cpu = cpu_delta(cpu_before, group_cpu_s(server.proc.pid))
                time.sleep(0.2)  # the API server records the last outputs' stats
                hist = histogram_delta(hist_before, server.itl_histogram())
                row[phase] = {k: float(result[k]) for k in FIGURES} | {"load_avg_1m": load, "cpu_s": cpu}
                row[phase] |= per_request(result) | ({"server_itl_hist": hist} if hist else {})
                fig = row[phase]
                per_token = engine_cpu_s(cpu) / max(1.0, fig["total_output_tokens"]) * 1e3
                server_itl = histogram_quantiles(hist) if hist else [float("nan")] * 2
                print(
                    f"  r{repeat} {name:15s} {dataset} c={concurrency} {phase:5s} itl p50 {fig['median_itl_ms']:.2f}"
                    f" p90 {fig['p90_itl_ms']:.2f} tpot p50 {fig['median_tpot_ms']:.2f} ttft p50"
                    f" {fig['median_ttft_ms']:.1f} engine cpu/token {per_token:.2f} ms"
                    f" bursts {fig['burst_fraction']:.0%} server itl p50 {server_itl[0]:.3f} p90 {server_itl[1]:.3f}"
                    f" load {load:.1f}",
                    file=sys.stderr,
                )
            out["rows"][f"{dataset}/c{concurrency}"] = row
    finally:
        server.stop()
    if stats.exists():
        worker = read_stats(stats, "worker")
        out["kvdi"] = {k: worker.get(k, 0) for k in ("saved_blocks", "loaded_blocks")}
    shutil.rmtree(store, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument("--datasets", default="prefix_repetition", help="prefix_repetition,random")
    parser.add_argument("--concurrency", default="4", help="comma-separated, e.g. 1,4,16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (ITL samples)")
    parser.add_argument("--server-priority", type=int, default=CLIENT_PRIORITY, help="the servers' niceness")
    parser.add_argument("--boots", type=int, default=300, help="bootstrap resamples of the pooled table")
    parser.add_argument(
        "--server-itl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="log stats on, vLLM's inter-token histogram read around each pass (--no-server-itl: log stats off)",
    )
    parser.add_argument("--settle-s", type=float, default=1.0)
    pin_help = "API server, engine core and client on the cores the worker leaves (see bench_serve_pin.py)"
    parser.add_argument("--pin", action="store_true", help=pin_help)
    parser.add_argument("--full", action="store_true", help="both datasets, concurrency 1, 4 and 16, 3 repeats")
    parser.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every server (-1: vLLM's default, which reserves one more core"
        " when any connector is configured)",
    )
    parser.add_argument("--multi-turn", action="store_true", help="also vLLM's multi-turn client")
    parser.add_argument("--multi-turn-only", action="store_true", help="vLLM's multi-turn client alone")
    parser.add_argument("--mt-rounds", type=int, default=1, help="multi-turn client runs per server (more samples)")
    parser.add_argument(
        "--before-tree",
        type=Path,
        default=None,
        help="a checkout of kvdi before a change: each kvdi configuration also runs as <name>@before with it",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if args.before_tree is not None:  # each kvdi configuration next to itself before the change
        configs = [x for c in configs for x in ((c, f"{c}{BEFORE}") if c in KVDI_CONFIGS else (c,))]
    if bad or args.repeats < 1 or args.prompts < 4:
        print(f"--configs {bad} / --repeats {args.repeats} / --prompts {args.prompts}: allowed {CONFIGS}, >= 1, >= 4")
        return 2
    if args.full:
        args.datasets, args.concurrency, args.repeats = "prefix_repetition,random", "1,4,16", max(args.repeats, 3)
    rows = [(d, int(c)) for d in args.datasets.split(",") for c in args.concurrency.split(",")]
    patch_version()
    priority = client_priority()
    SERVER_PRIORITY[0] = args.server_priority
    PIN[0] = args.pin
    priority = priority.replace(f"servers at {BASE_PRIORITY}", f"servers at {args.server_priority}")
    print(priority, file=sys.stderr)
    from kvdi.testing.redis_server import RedisServer

    results: list[dict[str, Any]] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvdi-bench-serve-") as tmp:
        work = Path(tmp)
        cache = ROOT / ".bench" / "serve"
        cache.mkdir(parents=True, exist_ok=True)
        args.model = model_with_tokenizer(make_tiny_llama(cache / "llama"), cache / "model")
        redis = RedisServer().start()
        try:
            for repeat in range(0 if args.multi_turn_only else args.repeats):
                # ABAB.. then BABA.., rotated every second repeat
                shift = repeat // 2 % len(configs)
                order = configs[shift:] + configs[:shift]
                order = order if repeat % 2 == 0 else order[::-1]
                for name in order:
                    results.append(serve_one(name, repeat, rows, args, work, redis.url))
            if args.multi_turn or args.multi_turn_only:
                args.redis_url = redis.url
                from benchmarks.vllm.bench_serve_multi_turn import run_multi_turn

                results.extend(run_multi_turn(configs, args, work, Server))
        finally:
            redis.stop()
    return publish("bench_serve", started, priority, args, results, table)


def publish(
    benchmark: str, started: float, priority: str, args: argparse.Namespace, results: list[dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
) -> int:  # fmt: skip
    """A run's document (its settings and every result): its tables (``render``) on stderr, the JSON on stdout, and
    with ``--out`` both written (``.txt`` beside the JSON); 0."""
    doc = {
        "benchmark": benchmark,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "minutes": round((time.time() - started) / 60, 1),
        "cpus": os.cpu_count(),
        "priority": priority,
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": results,
    }
    text = render(doc)
    print(text, file=sys.stderr)
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1))
        args.out.with_suffix(".txt").write_text(text + "\n")
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
