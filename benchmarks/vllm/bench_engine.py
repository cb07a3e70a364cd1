"""One vLLM engine for ``bench_vllm.py``: runs a list of phases with its own step loop, timing every token.

Usage: ``python -m benchmarks.vllm.bench_engine SPEC.json`` (``bench_vllm.py`` writes the spec).
SPEC holds ``model``, ``block_size``, ``max_model_len``, ``max_num_batched_tokens``,
``prefix_caching``, optionally ``kv`` (KVTransferConfig keyword arguments), ``out`` and
``phases``; each phase is one of

- ``{"kind": "round", "name": ..., "prompts": [[ids]...], "max_tokens": n, "reset": bool}``:
  every prompt is added at once and the engine steps until all finish;
- ``{"kind": "mix", "name": ..., "running": [[ids]...], "running_max_tokens": n,
  "arrivals": [[ids]...], "arrival_max_tokens": n, "every": k, "reset": bool}``: the running
  requests are added and stepped until each has its first token, then one arrival is added
  every ``k`` steps while the running requests decode.

A phase may name a ``barrier`` (a path): before the phase the engine creates ``PATH.ready`` and
waits (at most ``barrier_timeout_s``, default 120) until ``PATH.go`` exists, so the process that
started it can change the world between phases (``bench_remote.py`` sets its proxy's delay).
A phase running past ``phase_timeout_s`` (default 300) dumps all threads' stacks into the
log and exits non-zero. ``reset`` drops vLLM's own prefix cache first (the connector keeps its store), so the phase's
prompts come from the connector instead of vLLM's local hits. Times are ``time.perf_counter``
read right after each ``LLMEngine.step()``: with the engine core in-process a step's forward pass
and the connector's work in it are inside the step; with the multiprocess engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``) the core steps on its own and ``step()`` returns the next
step's outputs as they reach this process, so the times are when a client sees the tokens.

The result (JSON at ``out``): ``{"init_s", "phases": [{"name", "seconds", "ttft_s": [...],
"tokens": [[...]...], "reset_ok"}, ...]}``; a mix phase adds ``itl_s`` (the running requests'
inter-token gaps from the first arrival until the last arrival finished) and ``arrival_ttft_s``.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def finish(doc: dict[str, Any], out: Path | None, table: Callable[[dict[str, Any]], str], hide: str = "") -> int:
    """A benchmark's tail: the JSON on stdout (less ``hide``), compact at ``out``, the table and failures on stderr;
    the exit status (1 when tokens differ or an engine failed)."""
    print(json.dumps({k: v for k, v in doc.items() if k != hide}, indent=1))
    if out:
        out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")  # compact: it may be committed
    print(table(doc), file=sys.stderr)
    for f in doc["failures"]:
        print(f"FAILED engine {f['engine']}: {f['failed']} (log {f['log']})", file=sys.stderr)
    return 0 if doc["tokens_identical"] and not doc["failures"] else 1


class Driver:
    """Adds requests to one ``LLMEngine`` and records when each of their tokens came out."""

    def __init__(self, engine: Any, make_prompt: Any, make_params: Any) -> None:
        self.engine, self.make_prompt, self.make_params = engine, make_prompt, make_params
        self.counter = 0
        self.added: dict[str, float] = {}
        self.times: dict[str, list[float]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, float] = {}

    def add(self, prompt: list[int], max_tokens: int) -> str:
        """Add one greedy request; returns its id."""
        self.counter += 1
        rid = f"r{self.counter}"
        self.added[rid] = time.perf_counter()
        self.times[rid], self.tokens[rid] = [], []
        self.engine.add_request(rid, self.make_prompt(prompt), self.make_params(max_tokens))
        return rid

    def step(self) -> None:
        """One engine step; stamps every new token and finish with the time the step returned."""
        outputs = self.engine.step()
        now = time.perf_counter()
        for out in outputs:
            new = list(out.outputs[0].token_ids) if out.outputs else []
            self.tokens[out.request_id].extend(new)
            self.times[out.request_id].extend([now] * len(new))
            if out.finished:
                self.finished[out.request_id] = now

    def busy(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def ttft(self, rid: str) -> float:
        return self.times[rid][0] - self.added[rid]


def in_process() -> bool:
    """Whether vLLM runs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def reset_prefix_cache(llm: Any, driver: Driver) -> bool:
    """Drop vLLM's prefix cache, keeping the connector's store; retries while blocks are still held."""
    for _ in range(50):
        if llm.reset_prefix_cache(reset_running_requests=False, reset_connector=False):
            return True
        # Blocks held for a background save come back through get_finished on the next steps; a
        # multiprocess core steps by itself (and step() here would wait for outputs that never come).
        if in_process():
            driver.step()
        time.sleep(0.01)
    return False


def barrier(path: str, timeout_s: float) -> None:
    """Create ``path.ready``, then wait until ``path.go`` exists; RuntimeError past ``timeout_s``."""
    with open(path + ".ready", "w", encoding="utf-8"):
        pass
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path + ".go"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"barrier {path}: no {path}.go after {timeout_s}s")
        time.sleep(0.005)


def run_round(driver: Driver, phase: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    ids = [driver.add(p, phase["max_tokens"]) for p in phase["prompts"]]
    while driver.busy():
        driver.step()
    return {
        "seconds": time.perf_counter() - start,
        "ttft_s": [driver.ttft(r) for r in ids],
        "tokens": [driver.tokens[r] for r in ids],
    }


def run_mix(driver: Driver, phase: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    running = [driver.add(p, phase["running_max_tokens"]) for p in phase["running"]]
    while not all(driver.times[r] for r in running):
        driver.step()
    arrivals: list[str] = []
    pending = list(phase["arrivals"])
    steps = 0
    while driver.busy() or pending:
        if pending and steps % phase["every"] == 0:
            arrivals.append(driver.add(pending.pop(0), phase["arrival_max_tokens"]))
        driver.step()
        steps += 1
    window_start = driver.added[arrivals[0]]
    window_end = max(driver.finished[a] for a in arrivals)
    gaps: list[float] = []
    for rid in running:
        stamps = driver.times[rid]
        gaps.extend(b - a for a, b in itertools.pairwise(stamps) if window_start <= b <= window_end and b > a)
    return {
        "seconds": time.perf_counter() - start,
        "ttft_s": [driver.ttft(r) for r in running],
        "arrival_ttft_s": [driver.ttft(a) for a in arrivals],
        "itl_s": gaps,
        "tokens": [driver.tokens[r] for r in running + arrivals],
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the engine described by ``spec`` and run its phases in order."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "enable_prefix_caching": bool(spec["prefix_caching"]),
        "gpu_memory_utilization": 0.3,
        "max_model_len": spec["max_model_len"],
        "block_size": spec["block_size"],
        "max_num_batched_tokens": spec["max_num_batched_tokens"],
        "dtype": "float32",
        "seed": 0,
    }
    if spec.get("kv"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv"])
    start = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict[str, Any] = {"init_s": time.perf_counter() - start, "phases": []}

    def params(max_tokens: int) -> Any:
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )

    driver = Driver(llm.llm_engine, lambda p: TokensPrompt(prompt_token_ids=list(p)), params)
    for phase in spec["phases"]:
        # A phase that never ends (a load that never completes) dumps every thread's stack and exits.
        print(f"[bench_engine] phase {phase['name']}", file=sys.stderr, flush=True)
        if phase.get("barrier"):
            barrier(phase["barrier"], spec.get("barrier_timeout_s", 120))
        faulthandler.dump_traceback_later(spec.get("phase_timeout_s", 300), exit=True)
        reset_ok = reset_prefix_cache(llm, driver) if phase.get("reset") else None
        out = run_round(driver, phase) if phase["kind"] == "round" else run_mix(driver, phase)
        faulthandler.cancel_dump_traceback_later()
        result["phases"].append({"name": phase["name"], "reset_ok": reset_ok, **out})
    del llm  # lets the connector shut down and write its final stats file
    return result


if __name__ == "__main__":
    from tests.real_vllm.vllm_support import spec_main

    sys.exit(spec_main(sys.argv, run))
