"""Probe: the stalled passes of ``vllm serve`` on this machine, with no connector at all.

Usage (the vLLM venv, from the repository root)::

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.serve_stalls [--config none] [--passes 12] [--pin]

Runs :mod:`.bench_serve`'s passes (``cold``, ``hit``, ``load``, over and over; vLLM's ``bench serve`` client,
``prefix_repetition``, 32 prompts, concurrency 4) against one server of ``--config`` (``none``: no connector;
``noop``: the do-nothing connector) and prints, per pass, the client's TTFT p50 / p90 and median inter-token
gap, the pass's wall time, and the CPU ms of each server process (main thread / other threads). A pass whose
client saw whole responses at once (median gap under :data:`.bench_serve_switch.STALL_ITL_MS`) is marked
``STALLED`` and its requests' TTFTs are printed in order: the first waves are served token by token, then one
wave has a gap of a few hundred ms, and from there on every response reaches the client whole at its end.
That is vLLM's and this 2-core machine's, not kvdi's: :mod:`.bench_serve_switch` runs such passes again.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.vllm import bench_serve as serve
from benchmarks.vllm.bench_serve_pin import group_processes
from benchmarks.vllm.bench_serve_switch import STALL_ITL_MS, thread_cpu_ms
from benchmarks.vllm.vllm_cli import patch_version
from tests.real_vllm.serve_support import model_with_tokenizer
from tests.real_vllm.vllm_support import make_tiny_llama


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="none", choices=("none", "noop"))
    parser.add_argument("--passes", type=int, default=12)
    parser.add_argument("--pin", action="store_true", help="as bench_serve --pin")
    args = parser.parse_args(argv)
    if not 1 <= args.passes <= 1000:
        print(f"--passes {args.passes}: allowed 1-1000")
        return 2
    patch_version()
    serve.SERVER_PRIORITY[0] = serve.CLIENT_PRIORITY  # as bench_serve_switch: the client's priority for both
    print(serve.client_priority().replace(f"servers at {serve.BASE_PRIORITY}", f"servers at {serve.CLIENT_PRIORITY}"))
    serve.PIN[0] = args.pin
    cache = serve.ROOT / ".bench" / "serve"
    cache.mkdir(parents=True, exist_ok=True)
    model = model_with_tokenizer(make_tiny_llama(cache / "llama"), cache / "model")
    stalls = 0
    with tempfile.TemporaryDirectory(prefix="kvdi-serve-stalls-") as tmp:
        work = Path(tmp)
        kv = serve.kv_for(args.config, work / "store", "", work / "stats")
        server = serve.Server(model, work / "serve.log", kv, 2048, log_stats=True, reserved_cpus=1)
        try:
            server.wait_ready()
            serve.run_client(serve.client_args("random", 4, 8, 10_000, model, server.url))  # warm-up
            procs = group_processes(os.getpgid(server.proc.pid))
            for i in range(args.passes):
                phase = serve.PASSES[i % 3]
                if phase != "hit" and not server.reset_prefix_cache():
                    raise RuntimeError("reset_prefix_cache refused")
                time.sleep(1.2)  # as bench_serve_switch: settle, then the pass
                before = {pid: thread_cpu_ms(pid) for pid in procs}
                start = time.monotonic()
                argv_ = serve.client_args("prefix_repetition", 4, 32, 1000 + i // 3, model, server.url, 128)
                result = serve.run_client(argv_)
                wall = time.monotonic() - start
                cpu = " ".join(
                    f"{procs[pid].removeprefix('VLLM::')}:{now[0] - before[pid][0]:.0f}/{now[1] - before[pid][1]:.0f}"
                    for pid, now in ((pid, thread_cpu_ms(pid)) for pid in procs)
                )
                gap = float(result["median_itl_ms"])
                stalled = gap < STALL_ITL_MS
                stalls += stalled
                print(f"pass {i:3d} {phase:4s} wall {wall:5.2f} s  TTFT p50 {result['median_ttft_ms']:7.1f} p90 "
                      f"{result['p90_ttft_ms']:7.1f} ms  client ITL p50 {gap:6.3f} ms  cpu ms main/threads {cpu}"
                      + ("  STALLED" if stalled else ""), flush=True)  # fmt: skip
                if stalled:
                    print("    TTFT of each request in order (ms):", [round(t * 1e3) for t in result["ttfts"]])
        finally:
            server.stop()
    print(f"{stalls} of {args.passes} passes stalled ({args.config}, pin {args.pin})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
