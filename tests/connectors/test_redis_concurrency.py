"""Four real processes save and load the same prefixes through one redis-server at once.

Every process writes its own version of each block (different bytes under the same key),
so a torn object (half one writer's, half another's) cannot pass unnoticed: it would
either fail the frame checksum (counted as corrupt) or load bytes that match no writer.
"""

from __future__ import annotations

import multiprocessing as mp
import random
from typing import Any

import pytest

pytest.importorskip("redis")
torch = pytest.importorskip("torch")

from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata, run_transfer_step  # noqa: E402
from kvdi.connectors.store.keys import block_keys  # noqa: E402
from kvdi.testing.redis_server import RedisServer  # noqa: E402

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PROCESSES = 4
ROUNDS = 4
BLOCKS_PER_PROMPT = 4
BLOCK_SIZE = 16
PROMPTS = [[p * 1000 + t + 1 for t in range(BLOCKS_PER_PROMPT * BLOCK_SIZE + 1)] for p in range(4)]
SETTINGS: dict[str, Any] = {
    "kv_connector": "redis",
    "allocator": {"device": "cpu", "num_blocks": 2 * BLOCKS_PER_PROMPT},
    "model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16},
}


def version(writer: int, key: bytes, shape: tuple[int, ...], layer: int) -> Any:
    """Writer ``writer``'s bytes for one layer of the block stored under ``key``."""
    seed = int.from_bytes(key[:6], "little") * 131 + writer * 17 + layer
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run_client(url: str, writer: int, barrier: Any, results: Any) -> None:
    """One process: each round, load whatever prefix is stored and check it, then save its own version."""
    from kvdi.containers import build_kv_container

    container = build_kv_container(redis={"url": url}, **SETTINGS)
    layout, store, worker = container.layout(), container.backend(), container.worker_connector()
    caches = {n: torch.zeros(2 * BLOCKS_PER_PROMPT, *layout.block_shape) for n in layout.layer_names}
    worker.register_kv_caches(caches)
    rng = random.Random(writer)
    report = {"loaded": 0, "wrong": 0, "failed_loads": 0}
    barrier.wait()
    for _ in range(ROUNDS):
        for prompt in rng.sample(PROMPTS, len(PROMPTS)):
            keys = block_keys(prompt, layout)
            present = store.count_prefix(keys)
            load_ids = tuple(range(BLOCKS_PER_PROMPT, BLOCKS_PER_PROMPT + present))
            if present:
                failed = run_transfer_step(
                    worker, BlockTransferMetadata(loads=(BlockTransfer("l", load_ids, tuple(keys[:present])),))
                )
                report["failed_loads"] += len(failed)
                for slot, key in zip(load_ids, keys, strict=False):
                    if slot in failed:
                        continue
                    report["loaded"] += 1
                    matches = {
                        w
                        for w in range(PROCESSES)
                        if all(
                            torch.equal(caches[n][slot], version(w, key, layout.block_shape, i))
                            for i, n in enumerate(layout.layer_names)
                        )
                    }
                    report["wrong"] += len(matches) != 1
            for slot, key in enumerate(keys):
                for i, n in enumerate(layout.layer_names):
                    caches[n][slot] = version(writer, key, layout.block_shape, i)
            save_ids = tuple(range(len(keys)))
            run_transfer_step(worker, BlockTransferMetadata(saves=(BlockTransfer("s", save_ids, tuple(keys)),)))
    stats = worker.stats
    report.update(corrupt=stats.corrupt_dropped, saved=stats.saved_blocks, save_failures=stats.save_failures)
    container.shutdown_resources()
    results.put((writer, report))


def test_four_processes_share_prefixes_without_torn_or_wrong_kv(redis_server: RedisServer) -> None:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=run_client, args=(redis_server.url, w, barrier, results)) for w in range(PROCESSES)]
    for proc in procs:
        proc.start()
    reports = dict(results.get(timeout=180) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    totals = {k: sum(r[k] for r in reports.values()) for k in reports[0]}
    assert totals["wrong"] == totals["corrupt"] == totals["failed_loads"] == totals["save_failures"] == 0
    assert totals["loaded"] > 0
    assert totals["saved"] == PROCESSES * ROUNDS * len(PROMPTS) * BLOCKS_PER_PROMPT
