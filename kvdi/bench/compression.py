"""Compression rows for the network-store benches (``kvdi bench s3``, ``kvdi bench redis``).

For two kinds of KV and each ``compression`` (``none``, ``zstd``, ``zstd-split``, ``auto``), kvdi's worker half
saves the same blocks into the store and loads them back (every frame verified, compressed ones
decompressed into the paged cache); the codecs run alternated, repeated, and each save starts from
absent objects. The KV:

* ``random-ish``: float32 ``randn`` (the other benches' blocks): mantissas are noise;
* ``bf16``: bfloat16 ``0.05 x randn``, small values as real K/V are: the exponent bytes repeat.

Rows: save and load GB/s of ``zstd`` / ``auto`` against ``none`` on the same store (the ratio is
their cost or gain there: loopback, so the link is never the bottleneck and the figures are the
CPU's cost), and the bytes stored against the payload (ratio: payload / stored).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from kvdi.bench import BenchResult
from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata, WorkerConnector, run_transfer_step
from kvdi.connectors.store.keys import block_keys
from kvdi.containers import build_kv_container

CODECS = ("none", "zstd", "zstd-split", "auto")
DATA = {"random-ish": ("float32", 1.0), "bf16": ("bfloat16", 0.05)}


def compression_rows(
    bench: str,
    settings: Callable[[str], dict[str, Any]],
    num_blocks: int,
    repeats: int,
    model: dict[str, Any],
    block_size: int,
) -> list[BenchResult]:
    """Rows for ``bench``; ``settings(codec)`` gives build_kv_container's keywords for a store on that codec."""
    results: list[BenchResult] = []
    for data, (dtype, scale) in DATA.items():
        results += _measure(bench, data, dtype, scale, settings, num_blocks, repeats, model, block_size)
    return results


def _measure(
    bench: str, data: str, dtype: str, scale: float, settings: Callable[[str], dict[str, Any]],
    num_blocks: int, repeats: int, model: dict[str, Any], block_size: int,
) -> list[BenchResult]:  # fmt: skip
    import time

    import torch

    allocator = {"device": "cpu", "num_blocks": num_blocks, "block_size": block_size, "dtype": dtype}
    containers = {c: build_kv_container(**settings(c), model=model, allocator=allocator) for c in CODECS}
    pool = ThreadPoolExecutor(16)
    try:
        layout = containers["none"].layout()
        keys = tuple(block_keys(list(range(1, num_blocks * block_size + 2)), layout))
        ids = tuple(range(num_blocks))
        gen = torch.Generator().manual_seed(0)
        shape = (num_blocks, *layout.block_shape)
        source = {n: (torch.randn(shape, generator=gen) * scale).to(getattr(torch, dtype)) for n in layout.layer_names}
        save = BlockTransferMetadata(saves=(BlockTransfer("bench", ids, keys),))
        load = BlockTransferMetadata(loads=(BlockTransfer("bench", ids, keys),))
        halves: dict[str, tuple[Any, Any, dict[str, torch.Tensor]]] = {}
        for codec, container in containers.items():
            saver, loader = _worker(container), _worker(container)
            dest = {n: torch.zeros_like(t) for n, t in source.items()}
            saver.register_kv_caches(source)
            loader.register_kv_caches(dest)
            halves[codec] = (saver, loader, dest)

        def clear(codec: str) -> None:
            store = halves[codec][0].store
            list(pool.map(store.discard, keys))

        def timed(fn: Callable[[], object]) -> float:
            start = time.perf_counter()
            if fn():
                raise RuntimeError(f"bench: {bench} {data}: blocks failed to load")
            return time.perf_counter() - start

        times: dict[tuple[str, str], list[float]] = {(c, op): [] for c in CODECS for op in ("save", "load")}
        stored: dict[str, int] = {}
        for i in range(repeats + 1):  # the first round warms up (connections, allocations, contexts)
            for codec in CODECS if i % 2 == 0 else CODECS[::-1]:
                saver, loader, _ = halves[codec]
                clear(codec)
                took = timed(partial(run_transfer_step, saver, save))
                took_load = timed(partial(run_transfer_step, loader, load))
                if i:
                    times[codec, "save"].append(took)
                    times[codec, "load"].append(took_load)
                objects = halves[codec][0].store.get_many(list(keys))
                stored[codec] = sum(memoryview(o).nbytes for o in objects if o is not None)
        for codec, (_, _, dest) in halves.items():
            if any(not torch.equal(dest[n], source[n]) for n in layout.layer_names):
                raise RuntimeError(f"bench: {bench} {data} {codec}: blocks loaded differ from the blocks saved")
        rule = getattr(getattr(halves["auto"][0].store, "compressor", None), "rule", None)
        decisions = f"; auto's estimates and decisions: {rule.snapshot().describe()}" if rule is not None else ""
    finally:
        pool.shutdown()
        for container in containers.values():
            container.shutdown_resources()

    total = num_blocks * layout.block_bytes
    note = (
        f"{data} KV ({dtype}, {scale} x randn), {num_blocks} blocks x {layout.block_bytes >> 10} KiB, median of "
        f"{repeats} (codecs alternated); loopback: the CPU's cost, not a slow link's gain"
    )
    results = []
    for codec in CODECS[1:]:
        for op in ("save", "load"):
            mine, base = times[codec, op], times["none", op]
            gbs, base_gbs = total / statistics.median(mine) / 1e9, total / statistics.median(base) / 1e9
            spread = f"; spread (GB/s, min-max): {codec} {_span(total, mine)}, none {_span(total, base)}"
            results.append(
                BenchResult(
                    bench,
                    f"{data} {codec} {op}",
                    "GB/s",
                    gbs,
                    base_gbs,
                    "compression none",
                    gbs / base_gbs,
                    note=note + spread + (decisions if codec == "auto" else ""),
                )
            )
        mib, raw_mib = stored[codec] / (1 << 20), stored["none"] / (1 << 20)
        results.append(
            BenchResult(
                bench,
                f"{data} {codec} bytes stored",
                "MiB",
                mib,
                raw_mib,
                "compression none",
                raw_mib / mib,
                note=note + "; ratio: bytes stored plain / compressed",
            )
        )
    return results


def _worker(container: Any) -> WorkerConnector:
    half = container.worker_connector()
    if not isinstance(half, WorkerConnector):  # the container checks roles; this keeps mypy informed
        raise TypeError(f"expected a worker half, got {type(half).__name__}")
    return half


def _span(total: int, seconds: list[float]) -> str:
    return f"{total / max(seconds) / 1e9:.2f}-{total / min(seconds) / 1e9:.2f}"
