"""Redis: kvdi's worker half next to raw pipelined redis-py SET/GET of the same bytes, in one run.

Starts its own ``redis-server`` on a free loopback port, then a 3-master Redis Cluster
(baseline there: redis-py's ``ClusterPipeline``). The blocks are 1 MiB each (8 layers of
128 KiB); kvdi saves them through :class:`~kvdi.connectors.store.StoreWorkerConnector` (frame
header, xxh3 checksum, one pipelined ``SET`` per block) and loads them back into a paged
cache (one pipelined ``GET`` per block, every frame verified, payload copied into the cache).
The baseline sends the same payload bytes, already contiguous, with one pipelined ``SET`` /
``GET`` per block and does nothing with what it reads. Target: kvdi >= 0.7x the baseline, on both.

The *background load* row loads the same objects through the worker half's asynchronous path,
driven as vLLM drives it: one step binds a :class:`StoreTransferMetadata` whose ``async_loads``
hold :data:`BACKGROUND_REQUESTS` requests (an equal share of the blocks each) and starts them,
then empty steps (each waiting up to ``transfer.idle_load_wait_ms`` for a load, as vLLM's adapter
does) poll ``get_finished`` until every request was reported finished receiving; the time runs
until the last is reported. Its baseline is the same raw pipelined ``GET`` of all the objects.
Then the compression rows (:mod:`kvdi.bench.compression`) on the one server.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdi.bench import BenchResult
from kvdi.bench.compression import compression_rows
from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata, WorkerConnector, run_transfer_step
from kvdi.connectors.store import StoreTransferMetadata, StoreWorkerConnector
from kvdi.connectors.store.keys import block_keys
from kvdi.containers import build_kv_container
from kvdi.testing.redis_server import RedisServer

if TYPE_CHECKING:
    import torch

TARGET = 0.7
BACKGROUND_REQUESTS = 8
BLOCK_SIZE = 16
# 8 layers x (2 x 16 tokens x 8 heads x 128 dims x 4 B) = 8 x 128 KiB = 1 MiB per block.
MODEL = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "num_heads": 8, "hidden_size": 1024}


def _step(worker: WorkerConnector, meta: BlockTransferMetadata) -> None:
    failed = run_transfer_step(worker, meta)
    if failed:
        raise RuntimeError(f"bench: {len(failed)} blocks failed to load from redis")


def _background_load(worker: WorkerConnector, transfers: tuple[BlockTransfer, ...]) -> None:
    """One step starting ``transfers`` as asynchronous loads, then empty steps until each is reported received."""
    if not isinstance(worker, StoreWorkerConnector):
        raise TypeError(f"bench: background loads need a store worker half, got {type(worker).__name__}")
    idle_wait_s = worker.context.settings.transfer.idle_load_wait_ms / 1000
    waiting = {t.request_id for t in transfers}
    meta = StoreTransferMetadata(async_loads=transfers)
    while waiting:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv()
        if not meta.async_loads and idle_wait_s > 0:
            worker.wait_for_loads(idle_wait_s)  # an empty step, as vLLM's adapter waits on one
        _, received = worker.get_finished(set())
        failed = worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        if failed:
            raise RuntimeError(f"bench: {len(failed)} blocks failed to load from redis in the background")
        if received is not None and not received <= waiting:
            raise RuntimeError(f"bench: requests {sorted(received - waiting)} reported received twice or unknown")
        waiting -= received or set()
        meta = StoreTransferMetadata()


def _span(total: int, seconds: list[float]) -> str:
    return f"{total / max(seconds) / 1e9:.2f}-{total / min(seconds) / 1e9:.2f}"


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _worker(container: Any) -> WorkerConnector:
    half = container.worker_connector()
    if not isinstance(half, WorkerConnector):  # the container checks roles; this keeps mypy informed
        raise TypeError(f"expected a worker half, got {type(half).__name__}")
    return half


def _caches(names: tuple[str, ...], num_blocks: int, shape: tuple[int, ...], fill: bool) -> dict[str, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(0)
    if fill:
        return {name: torch.randn(num_blocks, *shape, generator=gen) for name in names}
    return {name: torch.zeros(num_blocks, *shape) for name in names}


def run(quick: bool) -> list[BenchResult]:
    """Save and load GB/s on one server and on a 3-master cluster, each next to raw redis-py pipelines."""
    from kvdi.testing.redis_server import RedisClusterServers

    num_blocks, repeats = (32, 5) if quick else (64, 9)
    with RedisServer() as server:
        results = _measure(server.url, False, num_blocks, repeats)

        def settings(codec: str) -> dict[str, Any]:
            redis = {"url": server.url, "op_timeout_s": 30.0, "key_prefix": f"kvdi-{codec}:", "compression": codec}
            return {"kv_connector": "redis", "redis": redis}

        results += compression_rows("redis", settings, num_blocks, repeats, MODEL, BLOCK_SIZE)
    with RedisClusterServers(masters=3) as cluster:
        results += _measure(cluster.url, True, num_blocks, repeats)
    return results


def _measure(url: str, cluster: bool, num_blocks: int, repeats: int) -> list[BenchResult]:
    """kvdi's worker half vs raw pipelined SET/GET of the same bytes on ``url``; medians of alternated runs."""
    import redis
    import redis.cluster

    settings: dict[str, Any] = {
        "kv_connector": "redis",
        "redis": {"url": url, "op_timeout_s": 30.0, "cluster": cluster},
        "model": MODEL,
        "allocator": {"device": "cpu", "num_blocks": num_blocks, "block_size": BLOCK_SIZE},
    }
    container = build_kv_container(**settings)
    try:
        layout = container.layout()
        tokens = list(range(1, num_blocks * BLOCK_SIZE + 2))
        keys = tuple(block_keys(tokens, layout))
        ids = tuple(range(num_blocks))
        source = _caches(layout.layer_names, num_blocks, layout.block_shape, fill=True)
        dest = _caches(layout.layer_names, num_blocks, layout.block_shape, fill=False)
        background = _caches(layout.layer_names, num_blocks, layout.block_shape, fill=False)
        saver, loader, bg_loader = _worker(container), _worker(container), _worker(container)
        saver.register_kv_caches(source)
        loader.register_kv_caches(dest)
        bg_loader.register_kv_caches(background)
        save_meta = BlockTransferMetadata(saves=(BlockTransfer("bench", ids, keys),))
        load_meta = BlockTransferMetadata(loads=(BlockTransfer("bench", ids, keys),))
        share = -(-num_blocks // BACKGROUND_REQUESTS)
        bg_loads = tuple(
            BlockTransfer(f"bench-bg{r}", ids[s : s + share], keys[s : s + share])
            for r, s in enumerate(range(0, num_blocks, share))
        )

        # The baseline: the same payload bytes, already one contiguous buffer per block.
        payloads = [b"".join(source[n][b].numpy().tobytes() for n in layout.layer_names) for b in range(num_blocks)]
        raw_keys = [b"bench-raw:" + k.hex().encode() for k in keys]
        client: Any = (
            redis.cluster.RedisCluster.from_url(url, socket_timeout=30.0)
            if cluster
            else redis.Redis.from_url(url, socket_timeout=30.0)
        )

        def raw_save() -> None:
            pipe = client.pipeline(transaction=False)
            for key, value in zip(raw_keys, payloads, strict=True):
                pipe.set(key, value)
            pipe.execute()

        def raw_load() -> None:
            pipe = client.pipeline(transaction=False)
            for key in raw_keys:
                pipe.get(key)
            pipe.execute()

        def clear(names: list[bytes]) -> None:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            pipe.execute()

        kvdi_names = [b"kvdi:" + k.hex().encode() for k in keys]
        ops: dict[str, tuple[Callable[[], None], list[bytes] | None]] = {
            "kvdi_save": (lambda: _step(saver, save_meta), kvdi_names),
            "raw_save": (raw_save, raw_keys),
            "kvdi_load": (lambda: _step(loader, load_meta), None),
            "raw_load": (raw_load, None),
            "kvdi_background_load": (lambda: _background_load(bg_loader, bg_loads), None),
        }
        for fn, _ in ops.values():  # warm up: connections, allocations, page faults
            fn()
        times: dict[str, list[float]] = {name: [] for name in ops}
        for i in range(repeats):
            # Alternate which side goes first, and start every save from absent keys, so
            # neither side inherits the other's server-side frees or allocations.
            order = (
                list(ops) if i % 2 == 0 else ["raw_save", "kvdi_save", "kvdi_background_load", "raw_load", "kvdi_load"]
            )
            for name in order:
                fn, names = ops[name]
                if names:
                    clear(names)
                times[name].append(_seconds(fn))
        client.close()
        if any(not dest[n].equal(source[n]) for n in layout.layer_names):
            raise RuntimeError("bench: blocks loaded from redis differ from the blocks saved")
        if any(not background[n].equal(source[n]) for n in layout.layer_names):
            raise RuntimeError("bench: blocks loaded from redis in the background differ from the blocks saved")
    finally:
        container.shutdown_resources()

    total = num_blocks * layout.block_bytes
    where = "3-master cluster, per-node pipelines" if cluster else "one server"
    shape = f"{num_blocks} blocks x {layout.block_bytes >> 20} MiB, median of {repeats} (alternating order)"
    note = f"{where}; {shape}; kvdi = StoreWorkerConnector (frame, xxh3, copy into the paged cache)"
    pipeline = "redis-py ClusterPipeline" if cluster else "pipelined redis-py"
    background_note = (
        f"{where}; {len(bg_loads)} requests x {share} blocks started in one step, polled by empty steps until the "
        f"last is reported received; median of {repeats}"
    )
    results = []
    for op, baseline, metric, why in (
        ("save", "save", "save throughput", note),
        ("load", "load", "load throughput", note),
        ("background_load", "load", "background load throughput", background_note),
    ):
        kvdi_gbs = total / statistics.median(times[f"kvdi_{op}"]) / 1e9
        raw_gbs = total / statistics.median(times[f"raw_{baseline}"]) / 1e9
        kvdi_span, raw_span = _span(total, times[f"kvdi_{op}"]), _span(total, times[f"raw_{baseline}"])
        spread = f"; spread (GB/s, min-max): kvdi {kvdi_span}, raw {raw_span}"
        results.append(
            BenchResult(
                "redis cluster" if cluster else "redis",
                metric,
                "GB/s",
                kvdi_gbs,
                raw_gbs,
                f"raw {pipeline} {'SET' if op == 'save' else 'GET'}",
                kvdi_gbs / raw_gbs,
                target=TARGET,
                note=why + spread,
            )
        )
    return results
