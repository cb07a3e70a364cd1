"""Helpers for the vLLM integration tests and benchmark: a tiny random Llama, engine runs, stats files.

Nothing here imports vLLM: engines run in subprocesses (``engine_run.py``), so pytest's
own process stays free of vLLM's worker processes and global state.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENGINE_RUN = HERE / "engine_run.py"
MODULE_PATH = "kvdi.integrations.vllm"
VOCAB = 512
ENGINE_TIMEOUT_S = 600
REQUIRE_ENV = "REQUIRE_VLLM_TESTS"
BLOCK_SIZE = 32
# 100 and 97 (= 3 * 32 + 1: vLLM's ExampleConnector misses this length) tokens, plus 64 and 130.
PROMPT_LENGTHS = (100, 97, 64, 130)
# Engine core and worker inside the engine's own process: fast start, and what cpu_offload needs.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def expected_blocks(prompts: list[list[int]], block_size: int = BLOCK_SIZE) -> int:
    """Blocks kvdi offers for ``prompts``: full blocks, leaving the last prompt token to compute."""
    return sum((len(p) - 1) // block_size for p in prompts)


def expected_saved(prompts: list[list[int]], block_size: int = BLOCK_SIZE) -> int:
    """Blocks kvdi stores for ``prompts``: every full prompt block."""
    return sum(len(p) // block_size for p in prompts)


def require_vllm() -> None:
    """Skip the calling test module when vLLM or transformers is missing; fail instead under ``REQUIRE_VLLM_TESTS=1``."""
    import importlib.util

    import pytest

    for module in ("vllm", "transformers"):
        if importlib.util.find_spec(module) is None:
            reason = f"{module} is not importable here; run .ci/vllm-tests.sh (it uses .venv-vllm)"
            if os.environ.get(REQUIRE_ENV) == "1":
                pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
            pytest.skip(reason, allow_module_level=True)


def scheduler_output(new: list[Any], cached: Any, scheduled: dict[str, int], finished: set[str] | None = None) -> Any:
    """vLLM's own ``SchedulerOutput`` of one step: ``new`` requests, ``cached`` (vLLM's ``CachedRequestData``),
    tokens scheduled per request id, and the ids that finished; no encoder inputs, no speculative tokens."""
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=finished or set(),
        free_encoder_mm_hashes=[],
    )


def make_tiny_llama(directory: Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2) -> Path:
    """Write a random Llama (safetensors, no tokenizer) to ``directory``; head_dim = hidden / heads (>= 32 for vLLM CPU)."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found,unused-ignore]

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def make_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids (never the EOS id)."""
    rnd = random.Random(seed)
    return [[rnd.randrange(3, VOCAB) for _ in range(length)] for _ in range(count)]


def kv_config(connector: str, *, role: str = "kv_both", stats_dir: Path | None = None, **kvdi: Any) -> dict[str, Any]:
    """KVTransferConfig kwargs selecting kvdi's ``connector``; ``kvdi`` become ``kvdi.<key>`` extra config."""
    extra: dict[str, Any] = {"kvdi.kv_connector": connector}
    extra.update({f"kvdi.{key.replace('__', '.')}": value for key, value in kvdi.items()})
    if stats_dir is not None:
        extra["kvdi_stats_dir"] = str(stats_dir)
    return {
        "kv_connector": "KvdiConnector",
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def run_engine(
    work: Path, name: str, spec: dict[str, Any], env: dict[str, str] | None = None, script: Path = ENGINE_RUN
) -> dict[str, Any]:
    """Run ``script`` (``engine_run.py``) with ``spec`` in a fresh interpreter; return its result or raise with
    the log tail."""
    work.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(work / f"{name}.out.json")}
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = work / f"{name}.log"
    child_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    child_env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    with log_path.open("w") as log:
        proc = subprocess.run(
            [sys.executable, str(script), str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env,
            timeout=ENGINE_TIMEOUT_S,
            check=False,
        )
    out = Path(spec["out"])
    if proc.returncode != 0 or not out.exists():
        tail = log_path.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"engine run {name!r} failed (rc={proc.returncode}); log {log_path}:\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = str(log_path)
    return result


def block_file(store: Path, prompt: list[int], index: int) -> Path:
    """The shared_storage file holding block ``index`` of ``prompt`` (keys chained from the layout fingerprint
    found in any stored header)."""
    from kvdi.connectors.store.keys import chain_keys, chain_seed

    any_object = next(p for p in store.rglob("*") if p.is_file() and not p.name.startswith("."))
    fingerprint = any_object.read_bytes()[8:24]
    key = chain_keys(prompt, BLOCK_SIZE, chain_seed(fingerprint, None))[index].hex()
    return store / key[:2] / key


def corrupt_copy(stored: dict[str, Any], name: str, prompt: list[int]) -> Path:
    """A copy of ``stored["store"]`` (a shared_storage folder) at ``stored["work"] / name`` with one payload byte
    of ``prompt``'s block 0 flipped (only the checksum can tell)."""
    store = stored["work"] / name
    shutil.copytree(stored["store"], store)
    victim = block_file(store, prompt, 0)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    return store


def spec_main(argv: list[str], run: Any) -> int:
    """Entry point of an engine script: read the JSON spec ``argv[1]``, ``run`` it, write the result atomically
    to the spec's ``out`` path."""
    with open(argv[1], encoding="utf-8") as fh:
        spec = json.load(fh)
    result = run(spec)
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(tmp, spec["out"])
    return 0


def read_stats(stats_dir: Path, role: str) -> dict[str, float]:
    """Sum of the cumulative kvdi counters the engines' ``role`` halves wrote to ``stats_dir``."""
    total: dict[str, float] = {}
    for path in glob.glob(str(stats_dir / f"*-{role}-*.json")):
        data = json.loads(Path(path).read_text())
        for key, value in data.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total


def read_stats_settled(stats_dir: Path, role: str, quiet_s: float = 1.0, timeout_s: float = 30.0) -> dict[str, float]:
    """:func:`read_stats` of a live engine, once its files stayed the same for ``quiet_s``: kvdi writes a stats
    file from a thread a moment after the counters move (kvdi.integrations.vllm.fleet.stats), not before the
    step's outputs reach the client."""
    deadline = time.monotonic() + timeout_s
    seen, since = read_stats(stats_dir, role), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        now = read_stats(stats_dir, role)
        if now != seen:
            seen, since = now, time.monotonic()
    return seen


def files_under(path: Path) -> tuple[int, int]:
    """(number of files, total bytes) under ``path``."""
    count = size = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            count += 1
            size += os.path.getsize(os.path.join(root, f))
    return count, size
