"""Four real processes saving and loading the same prefixes in one shared_storage directory."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import torch

from kvdi.connectors.base import KVRequest
from kvdi.layout import KVCacheSpec

LAYOUT = KVCacheSpec("conc", 4, 4, 64, 16, "float32")  # 128 KiB blocks: writes take long enough to race
BASE = list(range(1000, 1000 + 16 * 12))
PROMPTS = [[*BASE[:n], 7] for n in (48, 96, 144, 192)]  # nested prefixes: chains overlap
NUM_BLOCKS = 16


def expected_block(key: bytes) -> list[torch.Tensor]:
    """What every writer stores for a key (a function of the key only), so any reader can check it."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    return [torch.randn(LAYOUT.block_shape, generator=gen) for _ in range(LAYOUT.num_layers)]


def run_worker(root: str, index: int, rounds: int, results: Any) -> None:
    """One process: alternately load (checking every loaded byte) and save the prompts, in its own order."""
    from kvdi.connectors.shared_storage import FileBlockStore
    from kvdi.connectors.store.framing import HEADER_SIZE
    from kvdi.connectors.store.keys import block_keys
    from tests.helpers.store import Engine, make_settings

    store = FileBlockStore(Path(root), max_bytes=40 * (LAYOUT.block_bytes + HEADER_SIZE) if index % 2 else None)
    checked = torn = 0
    for r in range(rounds):
        prompt = PROMPTS[(index + r) % len(PROMPTS)]
        req = KVRequest(f"p{index}-{r}", tuple(prompt))
        keys = block_keys(prompt, LAYOUT)
        block_ids = tuple(range(len(prompt) // LAYOUT.block_size + 1))
        consumer = Engine(store, LAYOUT, make_settings(role="kv_consumer"), num_blocks=NUM_BLOCKS, io_thread=index < 2)
        for cache in consumer.caches.values():
            cache.fill_(float("nan"))
        n, errors = consumer.prefill(req, block_ids)
        for i in range(n // LAYOUT.block_size):
            if block_ids[i] in errors:
                continue
            checked += 1
            want = expected_block(keys[i])
            got = [c[block_ids[i]] for c in consumer.caches.values()]
            torn += not all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        torn += consumer.worker.stats.corrupt_dropped
        producer = Engine(store, LAYOUT, make_settings(role="kv_producer"), num_blocks=NUM_BLOCKS, io_thread=index < 2)
        for i, key in enumerate(keys):
            for cache, block in zip(producer.caches.values(), expected_block(key), strict=True):
                cache[block_ids[i]] = block
        producer.prefill(KVRequest(f"s{index}-{r}", tuple(prompt)), block_ids)
    results.put((index, checked, torn))


def test_four_processes_share_one_directory_without_torn_reads(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=run_worker, args=(str(tmp_path), i, 8, results)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    outcomes = sorted(results.get(timeout=5) for _ in procs)
    assert [torn for _, _, torn in outcomes] == [0, 0, 0, 0]
    assert sum(checked for _, checked, _ in outcomes) > 0
