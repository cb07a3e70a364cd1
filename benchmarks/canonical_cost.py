"""The canonical format's cost against per-rank frames on the same bytes: ``python -m benchmarks.canonical_cost``.

kvdi's real store worker half saves and loads the same 1 MiB blocks (8 layers x 2 x 16 tokens x 8 KV heads x
128 dims, fp32; ``nhc`` block order, vLLM's GPU default, so the canonical side converts every block) to
shared_storage folders, once with ``format=per_rank`` and once with ``format=canonical`` (``section_heads``,
the third argument, KV heads per section: 1 by default, 8 for one section a block). Rounds alternate ABBA,
BAAB; printed: each side's median, the ratio canonical / per_rank of the medians, and the lowest and highest
per-round ratio. Warm page cache. Arguments: ``[rounds] [blocks] [heads]``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorRole,
    run_transfer_step,
)
from kvdi.connectors.shared_storage import open_store
from kvdi.connectors.store import StoreWorkerConnector
from kvdi.connectors.store.keys import block_keys
from kvdi.layout import KVCacheSpec
from kvdi.settings import KvdiSettings

LAYOUT = KVCacheSpec("bench#canonical", 8, 8, 128, 16, "float32", block_order="nhc")


def _worker(root: Path, fmt: str, blocks: int, heads: int = 1) -> StoreWorkerConnector:
    options = {"path": str(root), "format": fmt, "section_heads": heads}
    s = KvdiSettings(kv_role="kv_both", engine_id="bench", shared_storage=options)
    store = open_store(s.shared_storage, LAYOUT, s)
    half = StoreWorkerConnector(ConnectorContext("shared_storage", KVConnectorRole.WORKER, s, LAYOUT, None, store))
    shape = (2 * blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, 2 * LAYOUT.head_dim)  # nhc blocks
    half.register_kv_caches({n: torch.randn(shape) for n in LAYOUT.layer_names})
    return half


def _timed(half: StoreWorkerConnector, keys: tuple[bytes, ...], save: bool) -> float:
    blocks = len(keys)
    ids = tuple(range(blocks)) if save else tuple(range(blocks, 2 * blocks))
    transfer = (BlockTransfer("r", ids, keys),)
    meta = BlockTransferMetadata(() if save else transfer, transfer if save else ())
    start = time.perf_counter()
    failed = run_transfer_step(half, meta)
    half.flush()
    took = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"{len(failed)} blocks failed to load")
    return took


def main(rounds: int = 6, blocks: int = 32, heads: int = 1) -> None:
    torch.set_num_threads(1)
    keys = tuple(block_keys(list(range(blocks * LAYOUT.block_size)), LAYOUT))
    with tempfile.TemporaryDirectory() as tmp:
        halves = {f: _worker(Path(tmp) / f, f, blocks, heads) for f in ("per_rank", "canonical")}
        for op, save in (("save", True), ("load", False)):
            times: dict[str, list[float]] = {f: [] for f in halves}
            for r in range(rounds):
                order = list(halves) if r % 4 in (0, 3) else list(halves)[::-1]  # ABBA BAAB
                for f in order:
                    times[f].append(_timed(halves[f], keys, save))
            med = {f: statistics.median(t) for f, t in times.items()}
            ratios = [c / p for c, p in zip(times["canonical"], times["per_rank"], strict=True)]
            print(
                f"{op} (section_heads={heads}): per_rank {med['per_rank'] * 1e3:.1f} ms, "
                f"canonical {med['canonical'] * 1e3:.1f} ms "
                f"({blocks} x 1 MiB); canonical/per_rank {med['canonical'] / med['per_rank']:.2f}x "
                f"(per round {min(ratios):.2f}-{max(ratios):.2f}x, {rounds} rounds)"
            )
        for half in halves.values():
            half.shutdown()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
