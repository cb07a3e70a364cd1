"""p2p: a producer process hands KV blocks to a consumer process over torch.distributed (gloo, CPU).

Two results, each measured in one run:

- ``transfer``: the consumer's worker half loading a batch of 1 MiB blocks from the
  producer (request over the TCPStore, header and one frames tensor over the process group,
  every frame checksum-verified, payloads copied into the paged cache) next to a raw
  ``send``/``recv`` of the same bytes between the same two processes on a process group of
  the same kind (a one-byte request, then the payload). GB/s of payload; target 0.8x.
- ``ttft``: time to first token on the consumer engine of a prompt whose KV the producer
  prefilled (loaded) next to the same prompt recomputed by a plain engine; ratio is
  recompute / loaded (higher is better). Measured with synchronous loads
  (``transfer.async_load=off``) and, as ``ttft-async``, with the default asynchronous loads
  (the request waits in WAITING_FOR_REMOTE_KVS while a background thread fetches).

Both sides run on the CPU (two processes on one GPU cannot form an NCCL pair); best of
several runs per side, since other processes on a shared machine only ever add time.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import socket
import time
from datetime import timedelta
from queue import Empty
from typing import Any

from kvdi.bench import BenchResult
from kvdi.connectors.base import SchedulerConnector, WorkerConnector
from kvdi.connectors.store.framing import HEADER_SIZE

MODEL = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "num_heads": 8, "hidden_size": 1024}
BLOCK_SIZE = 16  # 8 layers x 2 x 16 tokens x 8 heads x 128 dims x fp32 = 1 MiB a block
TIMEOUT_S = 60.0
WAIT_S = 300.0


def run(quick: bool) -> list[BenchResult]:
    """Transfer GB/s vs raw send/recv, then consumer TTFT loaded (sync, async) vs recomputed."""
    blocks, reps = (32, 8) if quick else (128, 12)
    prompt_len, prompts = (1024, 2) if quick else (2048, 3)
    return [
        measure_transfer(blocks, reps),
        measure_ttft(prompt_len, prompts, "off"),
        measure_ttft(prompt_len, prompts, "on"),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _settings(
    role: str, port: int, num_blocks: int, model: dict[str, Any], block_size: int, async_load: str = "off"
) -> Any:
    from kvdi.settings import load_settings

    return load_settings(
        kv_connector="p2p",
        kv_role=role,
        p2p={"kv_port": port, "kv_rank": 0 if role == "kv_producer" else 1, "timeout_s": TIMEOUT_S, "hold_s": WAIT_S},
        model=model,
        allocator={"device": "cpu", "num_blocks": num_blocks, "block_size": block_size},
        transfer={"async_load": async_load},
    )


def _run_pair(producer: Any, consumer: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    """Run both targets in spawned processes; returns what they report (bounded, kills overruns)."""
    ctx = mp.get_context("spawn")
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=t, args=(*args, out), daemon=True) for t in (producer, consumer)]
    for p in procs:
        p.start()
    reports: dict[str, Any] = {}
    try:
        while "result" not in reports:
            try:
                key, value = out.get(timeout=WAIT_S)
            except Empty:
                raise TimeoutError(f"p2p bench: no result within {WAIT_S:.0f}s") from None
            if key == "error":
                raise RuntimeError(f"p2p bench process failed: {value}")
            reports[key] = value
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return reports


# -- transfer -----------------------------------------------------------------------------
def _step(request: Any, blocks: tuple[int, ...], computed: int) -> Any:
    from kvdi.connectors.base import ScheduledRequest, SchedulerOutput

    return SchedulerOutput(1, (ScheduledRequest(request, blocks, computed, len(request.prompt_token_ids) - computed),))


def _halves(container: Any) -> tuple[SchedulerConnector, WorkerConnector]:
    sched, worker = container.scheduler_connector(), container.worker_connector()
    if not isinstance(sched, SchedulerConnector) or not isinstance(worker, WorkerConnector):
        raise TypeError("the p2p container built halves of the wrong role")
    return sched, worker


def _raw_group(port: int, rank: int) -> Any:
    import torch.distributed as dist

    from kvdi.connectors.p2p.rendezvous import host_store, join_store

    timeout = timedelta(seconds=TIMEOUT_S)
    store = host_store("127.0.0.1", port, timeout) if rank == 0 else join_store("127.0.0.1", port, timeout)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return store, dist.ProcessGroupGloo(dist.PrefixStore("raw", store), rank, 2, options)  # type: ignore[attr-defined]


def transfer_producer(port: int, raw_port: int, blocks: int, reps: int, out: Any) -> None:
    """Hold the same ``blocks`` once per fetch (one buffer, counted references), then serve raw sends."""
    try:
        import torch

        from kvdi.connectors.base import KVRequest
        from kvdi.containers import build_kv_container

        container = build_kv_container(_settings("kv_producer", port, blocks, MODEL, BLOCK_SIZE))
        sched, worker = _halves(container)
        layout = container.layout()
        gen = torch.Generator().manual_seed(0)
        worker.register_kv_caches(
            {n: torch.randn((blocks, *layout.block_shape), generator=gen) for n in layout.layer_names}
        )
        tokens = tuple(range(blocks * BLOCK_SIZE + 1))
        ids = tuple(range(blocks))
        for r in range(reps + 2):
            request = KVRequest(f"prefill-{r}", tokens)
            worker.bind_connector_metadata(sched.build_connector_meta(_step(request, ids, 0)))
            worker.wait_for_save()
            worker.clear_connector_metadata()
        out.put(("held", blocks))
        store, pg = _raw_group(raw_port, 0)
        payload = torch.randint(0, 255, (blocks * (layout.block_bytes + HEADER_SIZE),), dtype=torch.uint8)
        go = torch.zeros(1, dtype=torch.uint8)
        for r in range(reps + 1):
            pg.recv([go], 1, 2 * r).wait()
            pg.send([payload], 1, 2 * r + 1).wait()
        out.put(("raw_sent", reps))
        time.sleep(0.5)  # let the consumer read its last answer before the store goes
        container.shutdown_resources()
        del pg, store
    except Exception as exc:
        out.put(("error", f"producer: {type(exc).__name__}: {exc}"))


def transfer_consumer(port: int, raw_port: int, blocks: int, reps: int, out: Any) -> None:
    """Load all ``blocks`` ``reps + 1`` times through the worker half (first is warm-up), then raw recvs."""
    try:
        import torch

        from kvdi.connectors.base import KVRequest
        from kvdi.containers import build_kv_container

        container = build_kv_container(_settings("kv_consumer", port, blocks, MODEL, BLOCK_SIZE))
        sched, worker = _halves(container)
        layout = container.layout()
        worker.register_kv_caches({n: torch.zeros((blocks, *layout.block_shape)) for n in layout.layer_names})
        tokens = tuple(range(blocks * BLOCK_SIZE + 1))
        ids = tuple(range(blocks))
        deadline = time.monotonic() + WAIT_S
        while (sched.get_num_new_matched_tokens(KVRequest("probe", tokens), 0)[0] or 0) < blocks * BLOCK_SIZE:
            if time.monotonic() > deadline:
                raise TimeoutError("producer never published its blocks")
            time.sleep(0.05)
        store, pg = _raw_group(raw_port, 1)
        buf = torch.empty(blocks * (layout.block_bytes + HEADER_SIZE), dtype=torch.uint8)
        go = torch.ones(1, dtype=torch.uint8)
        kvdi: list[float] = []
        raw: list[float] = []
        for r in range(reps + 1):  # alternate, so load from other processes hits both alike
            request = KVRequest(f"decode-{r}", tokens)
            matched = sched.get_num_new_matched_tokens(request, 0)[0] or 0  # p2p never answers "ask again"
            sched.update_state_after_alloc(request, ids, matched)
            worker.bind_connector_metadata(sched.build_connector_meta(_step(request, ids, matched)))
            start = time.perf_counter()
            worker.start_load_kv()
            kvdi.append(time.perf_counter() - start)
            failed = worker.get_block_ids_with_load_errors()
            worker.clear_connector_metadata()
            if matched != blocks * BLOCK_SIZE or failed:
                raise RuntimeError(f"fetch {r}: matched {matched} tokens, {len(failed)} blocks failed")
            start = time.perf_counter()
            pg.send([go], 0, 2 * r).wait()
            pg.recv([buf], 0, 2 * r + 1).wait()
            raw.append(time.perf_counter() - start)
        out.put(("result", {"kvdi": min(kvdi[1:]), "raw": min(raw[1:]), "bytes": blocks * layout.block_bytes}))
        container.shutdown_resources()
        del pg, store
    except Exception as exc:
        out.put(("error", f"consumer: {type(exc).__name__}: {exc}"))


def measure_transfer(blocks: int, reps: int) -> BenchResult:
    """GB/s of one batched fetch of ``blocks`` 1 MiB blocks vs raw send/recv of the same bytes."""
    r = _run_pair(transfer_producer, transfer_consumer, (_free_port(), _free_port(), blocks, reps))["result"]
    kvdi, raw = r["bytes"] / r["kvdi"] / 1e9, r["bytes"] / r["raw"] / 1e9
    return BenchResult(
        "p2p", "transfer", "GB/s", kvdi, raw, "torch.distributed send/recv (gloo)", kvdi / raw, 0.8,
        f"{blocks} x 1 MiB blocks in one batch, verified and placed in the cache; best of {reps}",
    )  # fmt: skip


# -- time to first token ------------------------------------------------------------------
def _prompts(prompt_len: int, count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(count + 1)]


def ttft_producer(port: int, prompt_len: int, count: int, async_load: str, out: Any) -> None:
    """Prefill every prompt (one token each) so its KV is held for the consumer."""
    try:
        from kvdi.bench.ttft import BENCH_MODEL
        from kvdi.containers import build_engine_container

        blocks = 2 * -(-(prompt_len + 1) // BLOCK_SIZE) + 2
        container = build_engine_container(_settings("kv_producer", port, blocks, BENCH_MODEL, BLOCK_SIZE))
        engine = container.engine()
        for prompt in _prompts(prompt_len, count, BENCH_MODEL["vocab_size"]):
            engine.generate([prompt], 1)
        out.put(("prefilled", count + 1))
        deadline = time.monotonic() + WAIT_S
        channel = container.kv.backend()
        while len(channel.held) and time.monotonic() < deadline:  # until the consumer took everything
            time.sleep(0.05)
        container.shutdown_resources()
    except Exception as exc:
        out.put(("error", f"producer: {type(exc).__name__}: {exc}"))


def ttft_consumer(port: int, prompt_len: int, count: int, async_load: str, out: Any) -> None:
    """TTFT of each prompt loaded from the producer, then recomputed by a plain engine (first is warm-up)."""
    try:
        from kvdi.bench.ttft import BENCH_MODEL
        from kvdi.containers import build_engine_container

        blocks = 2 * -(-(prompt_len + 1) // BLOCK_SIZE) + 2
        container = build_engine_container(_settings("kv_consumer", port, blocks, BENCH_MODEL, BLOCK_SIZE, async_load))
        prompts = _prompts(prompt_len, count, BENCH_MODEL["vocab_size"])
        engine = container.engine()
        loaded: list[float] = []
        deadline = time.monotonic() + WAIT_S
        channel = container.kv.backend()
        from kvdi.connectors.store.keys import block_keys

        last = block_keys(prompts[-1], container.kv.layout())[:1]
        while not channel.count_published(last):  # wait for the producer's last prefill
            if time.monotonic() > deadline:
                raise TimeoutError("producer never prefilled")
            time.sleep(0.05)
        for prompt in prompts:
            (o,) = engine.generate([prompt], 1)
            if o.num_loaded_tokens == 0:
                raise RuntimeError(f"consumer loaded nothing: {o.error}")
            loaded.append(o.time_to_first_token_s or 0.0)
        container.shutdown_resources()
        allocator = {"device": "cpu", "num_blocks": blocks, "block_size": BLOCK_SIZE}
        plain = build_engine_container(kv_connector="null", kv_role="kv_both", model=BENCH_MODEL, allocator=allocator)
        recomputed = [o.time_to_first_token_s or 0.0 for p in prompts for o in plain.engine().generate([p], 1)]
        plain.shutdown_resources()
        out.put(("result", {"loaded": min(loaded[1:]), "recomputed": min(recomputed[1:])}))
    except Exception as exc:
        out.put(("error", f"consumer: {type(exc).__name__}: {exc}"))


def measure_ttft(prompt_len: int, count: int, async_load: str = "off") -> BenchResult:
    """Consumer TTFT with the prefix loaded from the producer vs recomputed, ``prompt_len`` tokens;
    ``async_load`` is the consumer's ``transfer.async_load`` (``on``: result ``ttft-async``)."""
    r = _run_pair(ttft_producer, ttft_consumer, (_free_port(), prompt_len, count, async_load))["result"]
    name, how = ("ttft-async", "asynchronous load") if async_load == "on" else ("ttft", "synchronous load")
    return BenchResult(
        "p2p", name, "s", r["loaded"], r["recomputed"], "recompute (null connector)", r["recomputed"] / r["loaded"],
        None, f"{prompt_len}-token prompt, KV prefilled by the producer process, {how}; best of {count}; "
        "ratio = speedup",
    )  # fmt: skip


__all__ = ["measure_transfer", "measure_ttft", "run"]
