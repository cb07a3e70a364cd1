"""Time to first token of a long prompt: recomputed (``null`` connector) vs loaded through the selected connector.

Both engines run the same model in this process. The loading engine (``kv_role=kv_both``,
connector from ``KVDI_KV_CONNECTOR``, ``shared_storage`` in a temporary directory by
default) first generates each prompt once to store its KV, then again, timed, loading
every full block but the last. ``ratio`` is recompute time / loaded time (higher is better).
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
from typing import Any

from kvdi.bench import BenchResult

# Large enough that a 1024-token prefill clearly costs more than reading its KV back
# (about 6 MiB), small enough to run in seconds on two CPU cores.
BENCH_MODEL: dict[str, Any] = {
    "model_id": "kvdi-bench-ttft",
    "num_layers": 6,
    "hidden_size": 384,
    "num_heads": 6,
    "num_kv_heads": 2,
    "head_dim": 64,
    "intermediate_size": 1024,
    "vocab_size": 2048,
    "max_model_len": 4096,
}


def run(quick: bool) -> list[BenchResult]:
    """One result: best time to first token over a few prompts, loaded vs recomputed.

    The best of several runs, not the median: on a shared machine other processes only
    ever add time, so the minimum is the least disturbed estimate of either path.
    """
    prompt_len, reps = (1024, 3) if quick else (2048, 3)
    with tempfile.TemporaryDirectory(prefix="kvdi-bench-ttft-") as tmp:
        return [measure(prompt_len, reps, Path(tmp))]


def measure(prompt_len: int, reps: int, store_dir: Path) -> BenchResult:
    """Time ``reps`` prompts of ``prompt_len`` tokens on a null engine and on a loading engine."""
    from kvdi.containers import build_engine_container
    from kvdi.settings import load_settings

    block_size = load_settings().allocator.block_size
    blocks = 2 * -(-(prompt_len + 1) // block_size) + 2
    common: dict[str, Any] = {
        "model": BENCH_MODEL,
        "allocator": {"num_blocks": blocks},
        "shared_storage": {"path": str(store_dir)},
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(BENCH_MODEL["vocab_size"]) for _ in range(prompt_len)] for _ in range(reps + 1)]
    warmup, timed = prompts[0], prompts[1:]

    baseline_c = build_engine_container(kv_connector="null", **common)
    loading_c = build_engine_container(kv_role="kv_both", **common)
    try:
        baseline, loading = baseline_c.engine(), loading_c.engine()
        connector = loading.connector_stats().connector
        baseline.generate([warmup], 1)
        loading.generate([warmup], 1)
        loading.generate([warmup], 1)
        recompute, loaded, loaded_tokens, same = [], [], 0, True
        for prompt in timed:
            ref = baseline.generate([prompt], 1)[0]
            loading.generate([prompt], 1)  # stores the prompt's KV
            out = loading.generate([prompt], 1)[0]
            recompute.append(ref.time_to_first_token_s or 0.0)
            loaded.append(out.time_to_first_token_s or 0.0)
            loaded_tokens = out.num_loaded_tokens
            same = same and ref.output_token_ids == out.output_token_ids
        baseline.shutdown()
        loading.shutdown()
    finally:
        baseline_c.shutdown_resources()
        loading_c.shutdown_resources()
    base_ms, kvdi_ms = min(recompute) * 1e3, min(loaded) * 1e3
    note = f"{prompt_len}-token prompt, best of {reps}, {loaded_tokens} tokens loaded via {connector!r}"
    if not same:
        note += "; FIRST TOKENS DIFFER"
    return BenchResult(
        bench="ttft",
        metric="time to first token (ratio = recompute / loaded)",
        unit="ms",
        kvdi=kvdi_ms,
        baseline=base_ms,
        baseline_name="recompute (null connector)",
        ratio=base_ms / kvdi_ms if kvdi_ms > 0 else 0.0,
        note=note,
    )
