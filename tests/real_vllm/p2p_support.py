"""One engine of a p2p producer/consumer pair inside real vLLM, and the helpers to run a pair.

Usage: ``python tests/real_vllm/p2p_support.py SPEC.json`` where SPEC holds what
``engine_run.py`` reads (``model``, ``block_size``, ``max_tokens``, ``kv``) plus ``role``
(``producer`` or ``consumer``), ``phases`` (lists of prompts, run one after the other),
``signals`` (a directory for marker files) and, for a producer, ``doomed``: after the
consumer's first phase it stops serving, takes the consumer's next fetch request off the
rendezvous queue and kills itself (SIGKILL) while the consumer waits for the answer.

The producer runs every phase (prefill and decode: its tokens are a plain engine's), writes
``prefilled`` and waits for ``done``; the consumer waits for ``prefilled``, then runs its
phases (after phase ``i`` it writes ``phase-i`` and, for a doomed producer, waits for
``serving-stopped``), then writes ``done``. Every wait is bounded by :data:`WAIT_S`.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WAIT_S = 400.0
TIMEOUT_S = 5.0  # KVDI_P2P__TIMEOUT_S of the pair: a dead producer costs at most this per fetch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(path: Path, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout_s:.0f}s")
        time.sleep(0.05)


def pair_kv(role: str, port: int, stats_dir: Path) -> dict[str, Any]:
    """KVTransferConfig kwargs of one side of a p2p pair on loopback (gloo). The auth token goes in
    ``KVDI_P2P__AUTH_TOKEN``, not here: vLLM logs its ``kv_connector_extra_config`` at start-up."""
    from tests.real_vllm.vllm_support import kv_config

    rank = 0 if role == "kv_producer" else 1
    return kv_config(
        "p2p",
        role=role,
        stats_dir=stats_dir,
        p2p__kv_port=port,
        p2p__kv_rank=rank,
        p2p__timeout_s=TIMEOUT_S,
        p2p__connect_timeout_s=WAIT_S,
    )


def run_pair(
    work: Path,
    base: dict[str, Any],
    phases: list[list[list[int]]],
    env: dict[str, str],
    *,
    doomed: bool = False,
    consumer_kvdi: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run a producer and a consumer engine (two processes, paired on a free loopback port); their results.

    ``consumer_kvdi``: more ``kvdi.*`` extra config for the consumer (e.g. ``{"transfer.async_load": "off"}``)."""
    work.mkdir(parents=True, exist_ok=True)
    port, token = free_port(), secrets.token_urlsafe(24)
    signals = work / "signals"
    signals.mkdir()
    procs: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
    child_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO", **env}
    child_env["KVDI_P2P__AUTH_TOKEN"] = token
    try:
        for side, role in (("producer", "kv_producer"), ("consumer", "kv_consumer")):
            kv = pair_kv(role, port, work / f"stats-{side}")
            if side == "consumer":
                kv["kv_connector_extra_config"].update({f"kvdi.{k}": v for k, v in (consumer_kvdi or {}).items()})
            spec = {
                **base,
                "role": side,
                "phases": phases,
                "signals": str(signals),
                "doomed": doomed,
                "kv": kv,
                "out": str(work / f"{side}.out.json"),
            }
            spec_path = work / f"{side}.spec.json"
            spec_path.write_text(json.dumps(spec))
            log = work / f"{side}.log"
            with log.open("w") as fh:
                proc = subprocess.Popen(
                    [sys.executable, str(HERE / "p2p_support.py"), str(spec_path)],
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    env=child_env,
                )
            procs[side] = (proc, log, Path(spec["out"]))
        deadline = time.monotonic() + WAIT_S + 120
        while any(proc.poll() is None for proc, _log, _out in procs.values()):
            for side, (proc, log, _out) in procs.items():  # one side failing ends the pair at once
                rc = proc.poll()
                if rc not in (None, 0) and not (side == "producer" and doomed and rc == -signal.SIGKILL):
                    raise RuntimeError(
                        f"{side} failed (rc={rc}); log {log}:\n{log.read_text(errors='replace')[-6000:]}"
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the pair did not finish within {WAIT_S + 120:.0f}s; logs in {work}")
            time.sleep(0.5)
        results: dict[str, Any] = {}
        for side, (proc, log, out) in procs.items():
            if not out.exists():
                raise RuntimeError(f"{side} wrote no result; log {log}:\n{log.read_text(errors='replace')[-6000:]}")
            results[side] = {"returncode": proc.returncode, "result": json.loads(out.read_text())}
        results["stats"] = {side: work / f"stats-{side}" for side in procs}
        return results
    finally:
        for proc, _log, _out in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


# -- inside one engine process ---------------------------------------------------------------------
def _take_fetch_and_die(kv: dict[str, Any]) -> None:
    """Producer: pop the consumer's next fetch request off the rendezvous queue, then SIGKILL this process."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from kvdi.connectors.p2p.protocol import REQUEST_QUEUE

    port = int(kv["kv_connector_extra_config"]["kvdi.p2p.kv_port"])
    store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=WAIT_S))
    while True:  # acknowledgements of the earlier phase may still be queued
        message = json.loads(bytes(store.queue_pop(REQUEST_QUEUE)))
        if "keys" in message:
            break
    os.kill(os.getpid(), signal.SIGKILL)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    signals = Path(spec["signals"])
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=512,
        block_size=spec.get("block_size", 32),
        dtype="float32",
        seed=0,
        kv_transfer_config=KVTransferConfig(**spec["kv"]),
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)

    phases = [[TokensPrompt(prompt_token_ids=p) for p in prompts] for prompts in spec["phases"]]
    result: dict[str, Any] = {"phases": []}
    if spec["role"] == "producer":
        for batch in phases:
            result["phases"].append(_generate(llm, params, batch))
        (signals / "prefilled").touch()
        if spec.get("doomed"):
            wait_for(signals / "phase-0")
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            get_kv_transfer_group().worker_half.channel.stop_serving()  # in-process engine core only
            write_result(spec, result)
            (signals / "serving-stopped").touch()
            _take_fetch_and_die(spec["kv"])
        wait_for(signals / "done")
    else:
        wait_for(signals / "prefilled")
        for i, batch in enumerate(phases):
            result["phases"].append(_generate(llm, params, batch))
            (signals / f"phase-{i}").touch()
            if spec.get("doomed") and i == 0:
                wait_for(signals / "serving-stopped")
        (signals / "done").touch()
    del llm  # connectors shut down: final stats files
    return result


def _generate(llm: Any, params: Any, prompts: list[Any]) -> dict[str, Any]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "seconds": seconds}


def write_result(spec: dict[str, Any], result: dict[str, Any]) -> None:
    tmp = spec["out"] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(tmp, spec["out"])


def main(argv: list[str]) -> int:
    with open(argv[1], encoding="utf-8") as fh:
        spec = json.load(fh)
    write_result(spec, run(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
