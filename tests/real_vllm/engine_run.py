"""Run one offline vLLM engine over token-id prompts and write the greedy tokens as JSON.

Usage: ``python tests/real_vllm/engine_run.py SPEC.json`` where SPEC holds ``model`` (a
directory), ``prompts`` (lists of token ids), ``rounds``, ``max_tokens``, ``block_size``,
``max_model_len``, ``out`` (where the result goes), optionally ``kv`` (KVTransferConfig
keyword arguments), ``prefix_caching`` (vLLM's own prefix cache, on unless false),
``tensor_parallel_size``, ``pipeline_parallel_size``, ``enforce_eager`` (default true),
``num_gpu_blocks`` (vLLM's ``num_gpu_blocks_override``), ``executor``
(``distributed_executor_backend``, e.g. ``"uni"``), ``log_stats`` (vLLM's periodic stats
log, where connector stats show up) and ``drain`` (in-process engines: step until vLLM
holds no request, then report its free blocks as ``result["drain"]``). An in-process engine settles
between rounds (steps until it holds no request), so a round looks up what the last one saved.
The result: ``{"init_seconds": s, "rounds": [{"seconds": s, "tokens": [[...], ...],
"finish_reasons": [...]}, ...]}``.

It is a script, not a test: vLLM spawns processes, so everything runs under the
``__main__`` guard, one engine per interpreter.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the engine described by ``spec``, run its rounds, return tokens and timings."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "skip_tokenizer_init": True,
        "enforce_eager": bool(spec.get("enforce_eager", True)),
        "enable_prefix_caching": bool(spec.get("prefix_caching", True)),
        "gpu_memory_utilization": 0.3,
        "max_model_len": spec.get("max_model_len", 512),
        "block_size": spec.get("block_size", 32),
        "dtype": spec.get("dtype", "float32"),
        "seed": 0,
    }
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("tensor_parallel_size"):
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
    if spec.get("num_gpu_blocks"):  # a tiny KV cache: vLLM preempts running requests to make room
        kwargs["num_gpu_blocks_override"] = spec["num_gpu_blocks"]
    if spec.get("pipeline_parallel_size"):
        kwargs["pipeline_parallel_size"] = spec["pipeline_parallel_size"]
    if spec.get("executor"):
        kwargs["distributed_executor_backend"] = spec["executor"]
    if spec.get("log_stats"):
        kwargs["disable_log_stats"] = False
    if spec.get("kv"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv"])
    start = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict[str, Any] = {"init_seconds": time.perf_counter() - start, "rounds": []}
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    for round_index in range(spec.get("rounds", 1)):
        if round_index and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            settle(llm)  # the last round's asynchronous saves have landed before this round looks them up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        reasons = [o.outputs[0].finish_reason for o in outputs]
        result["rounds"].append({"seconds": seconds, "tokens": tokens, "finish_reasons": reasons})
    if spec.get("drain"):
        result["drain"] = drain(llm)
    # Give the engine a chance to shut connectors down cleanly (final stats files).
    del llm
    return result


def settle(llm: Any, timeout: float = 60.0) -> None:
    """Step an in-process engine until it holds no request, finished ones whose saves are still running
    included (``async_save``: vLLM frees their blocks when the connector reports them sent)."""
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + timeout
    while core.scheduler.has_requests() and time.monotonic() < deadline:
        core.step()
        time.sleep(0.001)


def drain(llm: Any, max_steps: int = 1000) -> dict[str, int]:
    """Step an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) until its scheduler holds no request
    (finished ones whose blocks a connector still holds included); report what is left in vLLM's block pool."""
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    steps = 0
    while scheduler.has_requests() and steps < max_steps:
        core.step()
        steps += 1
    pool = scheduler.kv_cache_manager.block_pool
    return {
        "steps": steps,
        "requests_left": len(scheduler.requests),
        "free_blocks": pool.get_num_free_blocks(),
        "total_blocks": pool.num_gpu_blocks,
    }


if __name__ == "__main__":
    from vllm_support import spec_main

    sys.exit(spec_main(sys.argv, run))
