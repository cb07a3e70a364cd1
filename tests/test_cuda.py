"""kvdi on a CUDA GPU: the allocator, pinned staging, the cpu_offload pinned pool, device caches
staged through the store halves, and NCCL p2p between two GPUs.

Every test here is marked ``cuda`` and skipped when torch sees no CUDA device; nothing here
depends on the host lacking CUDA. ``.ci/gpu-check.sh`` runs exactly these
(``pytest -m cuda``) on a machine with a GPU.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
import torch

from kvdi.allocator import GpuBufferAllocator
from kvdi.connectors.base import KVRequest, ScheduledRequest, SchedulerOutput
from kvdi.connectors.store.blockio import CacheIO
from kvdi.containers import build_engine_container, build_kv_container
from kvdi.layout import KVCacheSpec
from kvdi.settings import AllocatorSettings

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPEC = KVCacheSpec("m", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
         "intermediate_size": 128, "vocab_size": 256, "max_model_len": 512}  # fmt: skip


def test_the_allocator_places_the_cache_on_cuda_and_plans_pinned_staging() -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cuda", num_blocks=5))
    caches = alloc.allocate()
    assert list(caches) == ["layers.0", "layers.1", "layers.2"]
    assert all(t.is_cuda and t.shape == (5, 2, 4, 2, 8) and not t.any() for t in caches.values())
    plan = alloc.plan()
    assert (plan.device, plan.staging_bytes, plan.staging_pinned) == ("cuda", 64 * 768, True)
    alloc.free()
    assert alloc.kv_caches == {}


def test_auto_picks_cuda_and_a_fraction_budget_reads_the_gpu_free_memory() -> None:
    plan = GpuBufferAllocator(SPEC, AllocatorSettings(device="auto", memory_fraction=0.001)).plan()
    _free, total = torch.cuda.mem_get_info()
    assert plan.device == "cuda" and plan.num_blocks >= 1 and plan.budget_bytes <= total * 0.001
    assert plan.budget_source.startswith("memory_fraction=0.001 of ")


@pytest.mark.parametrize("pin", [True, False])
def test_host_staging_is_pinned_exactly_when_pin_memory_is_on(pin: bool) -> None:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cuda", num_blocks=5, pin_memory=pin))
    alloc.allocate()
    host = alloc.staging(4096)
    device = alloc.staging(2048, device="cuda", owner="p2p-receiver")
    assert host.device.type == "cpu" and host.is_pinned() is pin
    assert device.is_cuda and not device.is_pinned()
    assert alloc.staging_nbytes == {"cpu": 4096, "cuda:0": 2048}
    alloc.free()
    assert alloc.staging_nbytes == {}


def test_cacheio_round_trips_a_cuda_cache_through_the_allocators_pinned_staging() -> None:
    src_alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cuda", num_blocks=6))
    dst_alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cuda", num_blocks=6))
    src_caches, dst_caches = src_alloc.allocate(), dst_alloc.allocate()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in src_caches.values():
        t.copy_(torch.randn(t.shape, generator=gen, device="cuda", dtype=t.dtype))
    src = CacheIO(list(src_caches.values()), SPEC.layer_block_bytes, chunk=2, buffers=src_alloc.staging)
    dst = CacheIO(list(dst_caches.values()), SPEC.layer_block_bytes, chunk=2, buffers=dst_alloc.staging)
    assert not src.direct and not dst.direct
    assert [b.is_pinned() for b in (*src_alloc.staging_buffers, *dst_alloc.staging_buffers)] == [True, True]
    payloads = [b"".join(bytes(p) for p in pieces) for pieces in src.save_pieces([1, 4])]
    assert [len(p) for p in payloads] == [SPEC.block_bytes] * 2
    for i, (block, payload) in enumerate(zip([0, 5], payloads, strict=True)):
        offset = 0
        for piece in dst.load_pieces(i, block):
            piece[:] = payload[offset : offset + piece.nbytes]
            offset += piece.nbytes
        dst.commit_load(i, block)
    dst.finish()
    for name in src_caches:
        assert torch.equal(dst_caches[name][[0, 5]], src_caches[name][[1, 4]])
        assert not dst_caches[name][[1, 2, 3, 4]].any()


def test_the_cpu_offload_pool_is_pageable_host_memory(kvdi_env: Path) -> None:
    """No device copy reads the pool (a CUDA cache's blocks go through the worker's pinned staging)."""
    c = build_kv_container(kv_connector="cpu_offload", model=MODEL, cpu_offload={"max_bytes": 1 << 22})
    try:
        store = c.backend()
        store.put_many([(b"k" * 16, [b"x" * 100])])
        assert bytes(store.get_many([b"k" * 16])[0]) == b"x" * 100
        pool = store._slots()  # the pool's one buffer (numpy view of the torch tensor owning it)
        assert not torch.from_numpy(pool).is_pinned()
    finally:
        c.shutdown_resources()


@pytest.mark.parametrize("async_load", ["off", "on"])
def test_store_halves_stage_a_cuda_cache_through_shared_storage(
    kvdi_env: Path, tmp_path: Path, async_load: str
) -> None:
    common: dict[str, Any] = {
        "allocator": {"device": "cuda", "num_blocks": 64, "block_size": 4},
        "model": MODEL,
        "shared_storage": {"path": str(tmp_path / "kv")},
        "transfer": {"async_load": async_load},
    }
    prompts = [list(range(3, 40))]
    containers = [
        build_engine_container(kv_connector=c, **common) for c in ("null", "shared_storage", "shared_storage")
    ]
    try:
        outputs = [c.engine().generate(prompts, 3)[0] for c in containers]
        loader = containers[2].alloc.allocator()
        assert loader.staging_nbytes.get("cpu", 0) > 0 and all(b.is_pinned() for b in loader.staging_buffers)
    finally:
        for c in containers:
            c.shutdown_resources()
    assert outputs[0].output_token_ids == outputs[1].output_token_ids == outputs[2].output_token_ids
    assert (outputs[1].num_loaded_tokens, outputs[2].num_loaded_tokens) == (0, 36)


# -- stream discipline (issue 22): compute on a non-default current stream, as vLLM does ------------------
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: keeps a stream busy for a good fraction of a second


def _io(num_blocks: int = 8) -> tuple[CacheIO, list[torch.Tensor], GpuBufferAllocator]:
    alloc = GpuBufferAllocator(SPEC, AllocatorSettings(device="cuda", num_blocks=num_blocks))
    caches = list(alloc.allocate().values())
    return CacheIO(caches, SPEC.layer_block_bytes, chunk=2, buffers=alloc.staging), caches, alloc


def _load_bytes(io: CacheIO, block: int, value: int) -> None:
    for piece in io.load_pieces(0, block):
        piece.cast("B")[:] = bytes([value]) * piece.nbytes
    io.commit_load(0, block)


def _block_bytes(caches: list[torch.Tensor], block: int) -> set[int]:
    return {int(v) for c in caches for v in c[block].view(torch.uint8).unique().tolist()}


def test_a_sync_save_reads_what_compute_just_wrote_on_the_engine_stream() -> None:
    io, caches, alloc = _io()
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(SLEEP_CYCLES)  # the write below is queued behind this
        for c in caches:
            c[3].view(torch.uint8).fill_(77)
        (pieces,) = io.save_pieces([3])  # the engine thread, right after the forward was queued
    assert {b for p in pieces for b in bytes(p)} == {77}
    alloc.free()


def test_an_async_load_lands_after_the_compute_queued_before_it_was_handed_over() -> None:
    """A reused block: its old owner's write is still queued on the compute stream when the load starts."""
    import threading

    io, caches, alloc = _io()
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(SLEEP_CYCLES)
        for c in caches:
            c[5].view(torch.uint8).fill_(11)  # the old owner's queued write
        fence = io.fence()  # start_load_kv, on the engine thread

    def job() -> None:
        with io.on_side_stream(fence):
            _load_bytes(io, 5, 99)
            io.finish()

    worker = threading.Thread(target=job)
    worker.start()
    worker.join()
    torch.cuda.synchronize()
    assert _block_bytes(caches, 5) == {99}
    alloc.free()


def test_an_async_load_does_not_wait_for_the_forward_queued_after_it() -> None:
    import threading

    io, caches, alloc = _io()
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        fence = io.fence()
        torch.cuda._sleep(10 * SLEEP_CYCLES)  # the next forward pass, queued after the hand-over
    finished_while_computing: list[bool] = []

    def job() -> None:
        with io.on_side_stream(fence):
            _load_bytes(io, 2, 42)
            io.finish()
        finished_while_computing.append(not compute.query())

    worker = threading.Thread(target=job)
    worker.start()
    worker.join()
    assert finished_while_computing == [True]
    compute.synchronize()
    assert _block_bytes(caches, 2) == {42}
    alloc.free()


def test_an_async_save_keeps_its_bytes_when_compute_overwrites_the_block() -> None:
    io, caches, alloc = _io()
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        for c in caches:
            c[1].view(torch.uint8).fill_(5)
        (pieces,) = io.save_pieces([1])  # copied out to staging before wait_for_save returns
        torch.cuda._sleep(SLEEP_CYCLES)
        for c in caches:
            c[1].view(torch.uint8).fill_(6)  # the block's next owner
    time.sleep(0.5)  # the store writes slowly, from staging
    assert {b for p in pieces for b in bytes(p)} == {5}
    alloc.free()


def test_finish_never_synchronizes_the_whole_device(monkeypatch: pytest.MonkeyPatch) -> None:
    io, caches, alloc = _io()

    def refuse(*_args: object) -> None:
        raise AssertionError("torch.cuda.synchronize on the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    _load_bytes(io, 4, 8)
    io.finish()
    io.save_pieces([4])
    assert _block_bytes(caches, 4) == {8}
    monkeypatch.undo()
    alloc.free()


def test_the_plan_counts_host_staging_on_the_host_and_device_staging_on_the_gpu() -> None:
    free, _total = torch.cuda.mem_get_info()
    settings = AllocatorSettings(device="cuda", num_blocks=5, max_staging_bytes=1 << 20)
    plan = GpuBufferAllocator(SPEC, settings).plan()
    assert plan.staging_bytes == 64 * SPEC.block_bytes and plan.device_staging_bytes == 1 << 20
    assert plan.total_bytes + plan.device_staging_bytes <= free


def test_the_layout_bridge_moves_a_step_through_bounded_scratch_on_the_engine_stream(tmp_path: Path) -> None:
    """vLLM's flash-attention layout (K and V outermost: blocks not contiguous) goes through the bridge's
    scratch on the GPU: 6 blocks with a 2-block bound move in 3 rounds each way, byte for byte, while the
    compute stream that wrote them is still busy, and the scratch never holds more than 2 blocks."""
    from kvdi.allocator import StagingBuffers
    from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata, ConnectorContext, KVConnectorRole
    from kvdi.connectors.shared_storage import FileBlockStore
    from kvdi.connectors.store import StoreWorkerConnector
    from kvdi.integrations.vllm.bridge import LayoutBridge
    from kvdi.integrations.vllm.layout import kvdi_layer_view
    from kvdi.settings import load_settings

    settings = load_settings(kv_role="kv_both", allocator={"max_staging_bytes": 2 * SPEC.block_bytes})
    context = ConnectorContext(
        "shared_storage", KVConnectorRole.WORKER, settings, SPEC, None, FileBlockStore(tmp_path), StagingBuffers(True)
    )
    worker = StoreWorkerConnector(context)
    shape = (2, 16, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    vllm_cache = {name: torch.zeros(shape, dtype=torch.float16, device="cuda") for name in SPEC.layer_names}
    views = {name: kvdi_layer_view(t, SPEC, num_blocks=16) for name, t in vllm_cache.items()}
    bridge = LayoutBridge(views, worker)
    assert not bridge.direct and bridge.max_slots == 2
    keys = tuple(f"k{b}".encode() for b in range(6))
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):  # vLLM's current stream: the bridge's copies queue behind its writes
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in vllm_cache.values():
            for b in range(6):
                t[:, b].view(torch.uint8).fill_(10 + b)
        worker.bind_connector_metadata(
            bridge.bind(BlockTransferMetadata((), (BlockTransfer("w", tuple(range(6)), keys),)))
        )
        bridge.save(worker.wait_for_save)
        worker.bind_connector_metadata(
            bridge.bind(BlockTransferMetadata((BlockTransfer("r", tuple(range(8, 14)), keys),)))
        )
        bridge.load(worker.start_load_kv)
    torch.cuda.synchronize()
    assert bridge.take_errors() == set()
    for t in vllm_cache.values():
        assert [set(t[:, 8 + b].view(torch.uint8).unique().tolist()) for b in range(6)] == [{10 + b} for b in range(6)]
    assert bridge.scratch_bytes <= 2 * SPEC.block_bytes
    assert all(s.device.type == "cuda" and s.shape[0] <= 2 for s in bridge.scratch.values())
    worker.shutdown()


# -- p2p with CUDA caches: gloo on one GPU, NCCL between two (one process per engine) ------------------
PROMPT = KVRequest("req-1", tuple(range(13)))  # block size 4: 3 loadable blocks
PRODUCER_BLOCKS, CONSUMER_BLOCKS, LOADED = (5, 6, 7, 8), (1, 2, 3, 4), 3
WAIT_S = 120.0
PEER_TIMEOUT_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gpu(role: str, backend: str) -> int:
    return 1 if backend == "nccl" and role == "kv_consumer" else 0


def _p2p_container(role: str, port: int, backend: str, timeout_s: float = 30.0) -> Any:
    gpu = _gpu(role, backend)
    torch.cuda.set_device(gpu)
    if backend == "nccl":  # one message per block and layer: several parts per layer
        import kvdi.connectors.p2p.channel as channel_module

        channel_module.PART_BYTES = 1
    return build_kv_container(
        kv_connector="p2p",
        kv_role=role,
        p2p={"kv_port": port, "kv_rank": 0 if role == "kv_producer" else 1, "backend": backend, "timeout_s": timeout_s},
        model={"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "hidden_size": 32},
        allocator={"device": f"cuda:{gpu}", "num_blocks": 16, "block_size": 4},
        transfer={"async_load": "off"},  # one synchronous step driven by hand
    )


def _caches(layout: Any, seed: int, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn((16, *layout.block_shape), generator=gen).to(device) for n in layout.layer_names}


def _step(blocks: tuple[int, ...], computed: int) -> SchedulerOutput:
    return SchedulerOutput(1, (ScheduledRequest(PROMPT, blocks, computed, len(PROMPT.prompt_token_ids) - computed),))


def _producer(port: int, backend: str, doomed: bool, out: Any, published: Any, done: Any) -> None:
    try:
        c = _p2p_container("kv_producer", port, backend, PEER_TIMEOUT_S if doomed else 30.0)
        sched, worker = c.scheduler_connector(), c.worker_connector()
        worker.register_kv_caches(_caches(c.layout(), 1, "cuda:0"))
        sched.update_state_after_alloc(PROMPT, PRODUCER_BLOCKS, sched.get_num_new_matched_tokens(PROMPT, 0)[0])
        worker.bind_connector_metadata(sched.build_connector_meta(_step(PRODUCER_BLOCKS, 0)))
        worker.wait_for_save()
        worker.clear_connector_metadata()
        if doomed:  # take the consumer's fetch request and die before answering it
            import os
            import signal
            from datetime import timedelta

            from kvdi.connectors.p2p.protocol import REQUEST_QUEUE

            c.backend().stop_serving()
            store = torch.distributed.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=WAIT_S))
            published.set()
            store.queue_pop(REQUEST_QUEUE)
            os.kill(os.getpid(), signal.SIGKILL)
        published.set()
        done.wait(WAIT_S)
        c.shutdown_resources()
    except Exception as exc:
        out.put(("producer_error", f"{type(exc).__name__}: {exc}"))


def _consumer(port: int, backend: str, doomed: bool, out: Any, published: Any, done: Any) -> None:
    try:
        c = _p2p_container("kv_consumer", port, backend, PEER_TIMEOUT_S if doomed else 30.0)
        sched, worker = c.scheduler_connector(), c.worker_connector()
        device = f"cuda:{_gpu('kv_consumer', backend)}"
        caches = _caches(c.layout(), 2, device)
        worker.register_kv_caches(caches)
        published.wait(WAIT_S)
        matched = sched.get_num_new_matched_tokens(PROMPT, 0)[0]
        sched.update_state_after_alloc(PROMPT, CONSUMER_BLOCKS, matched)
        compute = torch.cuda.Stream()  # vLLM computes on a stream of its own, kept busy here
        start = time.monotonic()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(SLEEP_CYCLES)
            for cache in caches.values():
                cache[list(CONSUMER_BLOCKS)] = 0.0  # the blocks' old owner's queued write
            worker.bind_connector_metadata(sched.build_connector_meta(_step(CONSUMER_BLOCKS, matched)))
            worker.start_load_kv()
        elapsed = time.monotonic() - start
        errors = sorted(worker.get_block_ids_with_load_errors())
        worker.clear_connector_metadata()
        torch.cuda.synchronize()
        expected = _caches(c.layout(), 1, device)
        same = all(
            torch.equal(caches[n][list(CONSUMER_BLOCKS[:LOADED])], expected[n][list(PRODUCER_BLOCKS[:LOADED])])
            for n in caches
        )
        out.put(("loaded", (matched, errors, same, elapsed)))
        done.set()
        c.shutdown_resources()
    except Exception as exc:
        out.put(("consumer_error", f"{type(exc).__name__}: {exc}"))
        done.set()


def _run_pair(backend: str, doomed: bool = False) -> tuple[Any, list[Any]]:
    ctx = mp.get_context("spawn")
    port, out, published, done = _free_port(), ctx.Queue(), ctx.Event(), ctx.Event()
    args = (port, backend, doomed, out, published, done)
    procs = [ctx.Process(target=f, args=args, daemon=True) for f in (_producer, _consumer)]
    for p in procs:
        p.start()
    reports: dict[str, Any] = {}
    try:
        deadline = time.monotonic() + WAIT_S
        while "loaded" not in reports:
            try:
                key, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except Empty:
                pytest.fail(f"no load report within {WAIT_S}s (got {reports})")
            assert not key.endswith("_error"), f"{key}: {value}"
            reports[key] = value
    finally:
        for p in procs:
            p.join(WAIT_S)
            if p.is_alive():
                p.kill()
                p.join(5)
    return reports["loaded"], procs


def test_gloo_p2p_loads_into_a_cuda_cache_under_a_busy_compute_stream(kvdi_env: Path) -> None:
    """Both engines on one GPU, the wire on the host (pinned staging): the loaded bytes land after the
    compute queued on the consumer's stream, so they are what the producer held."""
    (matched, errors, same, _elapsed), _procs = _run_pair("gloo")
    assert (matched, errors, same) == (LOADED * 4, [], True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL p2p needs two GPUs (one per process)")
def test_nccl_p2p_moves_blocks_from_one_gpu_to_another_in_several_parts_per_layer(kvdi_env: Path) -> None:
    (matched, errors, same, _elapsed), _procs = _run_pair("nccl")
    assert (matched, errors, same) == (LOADED * 4, [], True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL p2p needs two GPUs (one per process)")
def test_an_nccl_peers_death_mid_fetch_fails_the_load_and_leaves_the_consumer_alive(kvdi_env: Path) -> None:
    import signal

    (matched, errors, _same, elapsed), procs = _run_pair("nccl", doomed=True)
    assert matched == LOADED * 4 and errors == list(CONSUMER_BLOCKS[:LOADED])  # recomputed, not hung
    assert elapsed < PEER_TIMEOUT_S + 10.0
    assert procs[0].exitcode == -signal.SIGKILL and procs[1].exitcode == 0  # the consumer lived on
