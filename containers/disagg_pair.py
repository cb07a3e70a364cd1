"""A disaggregated prefill/decode pair in two processes, joined by the ``p2p`` connector.

Run it: ``python containers/disagg_pair.py [--port N] [--prompts 2] [--prompt-len 200]
[--new-tokens 8] [--json]``. Two engine processes start, each building its own
:class:`kvdi.containers.EngineContainer` from a TOML profile named by ``KVDI_SETTINGS_FILE``:
``settings/disagg-producer.toml`` (``kv_role=kv_producer``, rank 0, hosts the rendezvous)
and ``settings/disagg-consumer.toml`` (``kv_role=kv_consumer``, rank 1). A :class:`Router`
sends each batch to the prefill engine (one token, which computes the prompt and leaves its
KV held for the consumer), then to the decode engine, which loads that KV over
torch.distributed (asynchronously by default: a request waits for its KV while others run)
and computes only the tokens after it. The script also runs the prompts
on one plain engine (``kv_connector=null``) and prints whether the tokens match; it exits 0
when they match and the decode engine really loaded tokens.

``--port 0`` picks a free loopback port; otherwise the profiles' ``kv_port`` is used.
``KVDI_*`` env vars reach both engines (env beats the profile); unless
``KVDI_P2P__AUTH_TOKEN`` is set, the two engines share a fresh random token. To deploy the halves on two
hosts, start each with its profile and ``kvdi`` engine code of your own; this file is the
smallest runnable composition to copy from.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import secrets
import socket
import sys
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from queue import Empty
from typing import Any

from kvdi.containers import EngineContainer, build_engine_container
from kvdi.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
PRODUCER_FILE = ROOT / "settings" / "disagg-producer.toml"
CONSUMER_FILE = ROOT / "settings" / "disagg-consumer.toml"
STEP_TIMEOUT_S = 120.0

Summary = dict[str, Any]


def build_engine(settings_file: Path, env: dict[str, str]) -> EngineContainer:
    """One side's container: its profile through ``KVDI_SETTINGS_FILE``, plus ``env`` (e.g. the port)."""
    os.environ["KVDI_SETTINGS_FILE"] = str(settings_file)
    os.environ.update(env)
    return build_engine_container()


def summarize(output: Any) -> Summary:
    """What the router needs of a RequestOutput (plain data, so it crosses processes)."""
    return {
        "output_token_ids": list(output.output_token_ids),
        "num_loaded_tokens": output.num_loaded_tokens,
        "num_computed_prompt_tokens": output.num_computed_prompt_tokens,
        "time_to_first_token_s": output.time_to_first_token_s,
        "error": output.error,
    }


def serve(settings_file: str, env: dict[str, str], inbox: Any, outbox: Any) -> None:
    """Body of one engine process: answer ``(prompts, max_new_tokens)`` jobs until ``None``."""
    container: EngineContainer | None = None
    try:
        container = build_engine(Path(settings_file), env)
        engine = container.engine()
        outbox.put(("ready", None))
        while (job := inbox.get()) is not None:
            prompts, max_new_tokens = job
            outbox.put(("done", [summarize(o) for o in engine.generate(prompts, max_new_tokens)]))
    except Exception as exc:  # reported to the router, which stops the pair
        outbox.put(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if container is not None:
            container.shutdown_resources()


class EngineProcess:
    """One engine in its own process; every wait on it is bounded."""

    def __init__(self, name: str, settings_file: Path, env: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self._inbox: Any = ctx.Queue()
        self._outbox: Any = ctx.Queue()
        self.process: BaseProcess = ctx.Process(
            target=serve, args=(str(settings_file), env, self._inbox, self._outbox), name=name, daemon=True
        )

    def start(self) -> None:
        self.process.start()

    def _reply(self, timeout_s: float) -> Any:
        try:
            kind, value = self._outbox.get(timeout=timeout_s)
        except Empty:
            raise TimeoutError(f"{self.name} engine did not answer within {timeout_s:.0f}s") from None
        if kind == "error":
            raise RuntimeError(f"{self.name} engine failed: {value}")
        return value

    def wait_ready(self, timeout_s: float = STEP_TIMEOUT_S) -> None:
        self._reply(timeout_s)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Summary]:
        self._inbox.put(([list(p) for p in prompts], max_new_tokens))
        result: list[Summary] = self._reply(STEP_TIMEOUT_S)
        return result

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the process to shut down; kill it if it does not within ``timeout_s``."""
        if self.process.is_alive():
            self._inbox.put(None)
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class Router:
    """Sends a batch to prefill (one token: computes the prompts, holds their KV), then to decode."""

    def __init__(self, prefill: EngineProcess, decode: EngineProcess) -> None:
        self.prefill = prefill
        self.decode = decode

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Summary]:
        prefilled = self.prefill.generate(prompts, 1)
        failed = [p["error"] for p in prefilled if p["error"]]
        if failed:
            raise RuntimeError(f"prefill failed: {failed[0]}")
        return self.decode.generate(prompts, max_new_tokens)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def device_env() -> tuple[dict[str, str], dict[str, str], str]:
    """Devices unless ``KVDI_ALLOCATOR__DEVICE`` is set: one GPU each with two or more, else both on CPU."""
    if os.environ.get("KVDI_ALLOCATOR__DEVICE"):
        device = os.environ["KVDI_ALLOCATOR__DEVICE"]
        return {}, {}, device
    import torch

    if torch.cuda.device_count() >= 2:
        return {"KVDI_ALLOCATOR__DEVICE": "cuda:0"}, {"KVDI_ALLOCATOR__DEVICE": "cuda:1"}, "cuda:0"
    cpu = {"KVDI_ALLOCATOR__DEVICE": "cpu"}
    return cpu, cpu, "cpu"


def reference_tokens(prompts: Sequence[Sequence[int]], max_new_tokens: int, device: str) -> list[list[int]]:
    """Greedy tokens of one plain engine with the producer profile's model (no connector)."""
    os.environ["KVDI_SETTINGS_FILE"] = str(PRODUCER_FILE)
    container = build_engine_container(kv_connector="null", kv_role="kv_both", allocator={"device": device})
    try:
        return [list(o.output_token_ids) for o in container.engine().generate(prompts, max_new_tokens)]
    finally:
        container.shutdown_resources()


def run(port: int | None, prompts: int, prompt_len: int, new_tokens: int) -> Summary:
    """Start the pair, route the prompts, compare with one engine; returns a report (``match`` says it all)."""
    env: dict[str, str] = {} if port is None else {"KVDI_P2P__KV_PORT": str(port or free_port())}
    if not os.environ.get("KVDI_P2P__AUTH_TOKEN"):  # the pair shares a fresh secret: nobody else can join it
        env["KVDI_P2P__AUTH_TOKEN"] = secrets.token_urlsafe(32)
    prefill_env, decode_env, ref_device = device_env()
    rng = random.Random(0)
    os.environ["KVDI_SETTINGS_FILE"] = str(PRODUCER_FILE)
    vocab = load_settings().model.vocab_size
    batch = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(prompts)]
    pair = [
        EngineProcess("prefill", PRODUCER_FILE, {**env, **prefill_env}),
        EngineProcess("decode", CONSUMER_FILE, {**env, **decode_env}),
    ]
    try:
        for engine in pair:
            engine.start()
        for engine in pair:
            engine.wait_ready()
        decoded = Router(*pair).generate(batch, new_tokens)
    finally:
        for engine in pair:
            engine.stop()
    expected = reference_tokens(batch, new_tokens, ref_device)
    results = [
        {**d, "expected_token_ids": e, "match": d["output_token_ids"] == e}
        for d, e in zip(decoded, expected, strict=True)
    ]
    match = all(r["match"] and not r["error"] and r["num_loaded_tokens"] > 0 for r in results)
    return {"match": match, "prompt_len": prompt_len, "new_tokens": new_tokens, "requests": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--port", type=int, default=None, help="rendezvous port (0: a free one; default: the profiles')"
    )
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = parser.parse_args(argv)
    report = run(args.port, args.prompts, args.prompt_len, args.new_tokens)
    if args.json:
        print(json.dumps(report))
    else:
        for i, r in enumerate(report["requests"]):
            print(
                f"prompt {i}: decode    {r['output_token_ids']} (loaded {r['num_loaded_tokens']} prompt tokens, "
                f"computed {r['num_computed_prompt_tokens']}){'' if not r['error'] else ' error: ' + r['error']}"
            )
            print(f"prompt {i}: one engine {r['expected_token_ids']}")
        print(f"match: {'yes' if report['match'] else 'no'}")
    return 0 if report["match"] else 1


if __name__ == "__main__":
    sys.exit(main())
