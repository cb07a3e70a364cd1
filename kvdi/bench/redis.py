"""Redis: kvdi's worker half next to raw pipelined redis-py SET/GET of the same bytes, in one run.

Starts its own ``redis-server`` on a free loopback port. The blocks are 1 MiB each (8 layers of
128 KiB); kvdi saves them through :class:`~kvdi.connectors.store.StoreWorkerConnector` (frame
header, xxh3 checksum, one pipelined ``SET`` per block) and loads them back into a paged
cache (one pipelined ``GET`` per block, every frame verified, payload copied into the cache).
The baseline sends the same payload bytes, already contiguous, with one pipelined ``SET`` /
``GET`` per block and does nothing with what it reads. Target: kvdi >= 0.7x the baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvdi.bench import BenchResult
from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata, WorkerConnector, run_transfer_step
from kvdi.connectors.keys import block_keys
from kvdi.containers import build_kv_container
from kvdi.testing.redis_server import RedisServer

if TYPE_CHECKING:
    import torch

TARGET = 0.7
BLOCK_SIZE = 16
# 8 layers x (2 x 16 tokens x 8 heads x 128 dims x 4 B) = 8 x 128 KiB = 1 MiB per block.
MODEL = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "num_heads": 8, "hidden_size": 1024}


def _step(worker: WorkerConnector, meta: BlockTransferMetadata) -> None:
    failed = run_transfer_step(worker, meta)
    if failed:
        raise RuntimeError(f"bench: {len(failed)} blocks failed to load from redis")


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
    """Save and load GB/s: kvdi's redis worker half vs raw pipelined redis-py, on the same 1 MiB blocks."""
    import redis

    num_blocks, repeats = (32, 6) if quick else (64, 12)
    with RedisServer() as server:
        settings: dict[str, Any] = {
            "kv_connector": "redis",
            "redis": {"url": server.url, "op_timeout_s": 30.0},
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
            saver, loader = _worker(container), _worker(container)
            saver.register_kv_caches(source)
            loader.register_kv_caches(dest)
            save_meta = BlockTransferMetadata(saves=(BlockTransfer("bench", ids, keys),))
            load_meta = BlockTransferMetadata(loads=(BlockTransfer("bench", ids, keys),))

            # The baseline: the same payload bytes, already one contiguous buffer per block.
            payloads = [b"".join(source[n][b].numpy().tobytes() for n in layout.layer_names) for b in range(num_blocks)]
            raw_keys = [b"bench-raw:" + k.hex().encode() for k in keys]
            client: redis.Redis = redis.Redis.from_url(server.url, socket_timeout=30.0)

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

            def kvdi_save() -> None:
                _step(saver, save_meta)

            def kvdi_load() -> None:
                _step(loader, load_meta)

            kvdi_names = [b"kvdi:" + k.hex().encode() for k in keys]
            ops: dict[str, tuple[Callable[[], None], list[bytes] | None]] = {
                "kvdi_save": (kvdi_save, kvdi_names),
                "raw_save": (raw_save, raw_keys),
                "kvdi_load": (kvdi_load, None),
                "raw_load": (raw_load, None),
            }
            for fn, _ in ops.values():  # warm up: connections, allocations, page faults
                fn()
            best = dict.fromkeys(ops, float("inf"))
            for i in range(repeats):
                # Alternate which side goes first, and start every save from absent keys, so
                # neither side inherits the other's server-side frees or allocations.
                order = list(ops) if i % 2 == 0 else ["raw_save", "kvdi_save", "raw_load", "kvdi_load"]
                for name in order:
                    fn, clear = ops[name]
                    if clear:
                        client.delete(*clear)
                    best[name] = min(best[name], _seconds(fn))
            client.close()
            if any(not dest[n].equal(source[n]) for n in layout.layer_names):
                raise RuntimeError("bench: blocks loaded from redis differ from the blocks saved")
        finally:
            container.shutdown_resources()

    total = num_blocks * layout.block_bytes
    shape = f"{num_blocks} blocks x {layout.block_bytes >> 20} MiB, best of {repeats} (alternating order)"
    note = f"{shape}; kvdi = StoreWorkerConnector over RedisBlockStore (frame, xxh3, copy into the paged cache)"
    results = []
    for op in ("save", "load"):
        kvdi_gbs, raw_gbs = total / best[f"kvdi_{op}"] / 1e9, total / best[f"raw_{op}"] / 1e9
        results.append(
            BenchResult(
                "redis",
                f"{op} throughput",
                "GB/s",
                kvdi_gbs,
                raw_gbs,
                f"raw pipelined redis-py {'SET' if op == 'save' else 'GET'}",
                kvdi_gbs / raw_gbs,
                target=TARGET,
                note=note,
            )
        )
    return results
