"""The canonical stored format's cost against per-rank frames on the same bytes (``kvdi bench canonical``).

kvdi's real store worker half saves and loads the same 1 MiB blocks (8 layers x 2 x 16 tokens x 8 KV heads x
128 dims, fp32) to shared_storage folders, once with ``format=per_rank`` and once with ``format=canonical``, for
the grids of :data:`GRIDS`: ``section_heads=8`` (one section a block: the format's own cost) and
``section_heads=1`` (a section a head, what a fleet of any TP size shares: still one object a block, a pack of
the eight sections), the latter under ``hnc`` blocks (vLLM's CPU order, where a head's bytes of a layer are one
run: no conversion) and under ``nhc`` blocks (vLLM's GPU order, where they are not: converted on the way in and
out, one strided copy each way). Three operations (:data:`OPS`), both sides on the same blocks: ``save`` of
blocks never stored before (fresh keys each round, as the scheduler saves what the store lacks), ``re-save`` of
blocks already stored (per-rank frames are rewritten; canonical packs, published once, are kept) and ``load``.
Rounds alternate ABBA, BAAB; each row is the ratio of the medians, with the lowest and highest per-round ratio
in its note. Warm page cache. The files go under ``TMPDIR`` (the file system matters: a file's creation is most
of a small object's cost). The issue's bar (at most 10 % over per-rank frames) is the target of every row.
``benchmarks/canonical_cost.py`` prints the same from the command line.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvdi.bench import BenchResult
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
TARGET = 1.10
OPS = ("save", "re-save", "load")


@dataclass(frozen=True)
class Cost:
    """One operation's medians (seconds) on each side and the per-round ratios canonical / per_rank."""

    op: str
    section_heads: int
    per_rank: float
    canonical: float
    ratios: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return self.canonical / self.per_rank


def _worker(root: Path, fmt: str, blocks: int, heads: int, layout: KVCacheSpec = LAYOUT) -> StoreWorkerConnector:
    options = {"path": str(root), "format": fmt, "section_heads": heads}
    s = KvdiSettings(kv_role="kv_both", engine_id="bench", shared_storage=options)
    store = open_store(s.shared_storage, layout, s)
    half = StoreWorkerConnector(ConnectorContext("shared_storage", KVConnectorRole.WORKER, s, layout, None, store))
    shape = (2 * blocks, *layout.block_shape)
    half.register_kv_caches({n: torch.randn(shape) for n in layout.layer_names})
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


def _keys(blocks: int, round_: int) -> tuple[bytes, ...]:
    """``blocks`` block keys of their own for save round ``round_`` (fresh blocks, never stored before)."""
    first = round_ * blocks * LAYOUT.block_size
    return tuple(block_keys(list(range(first, first + blocks * LAYOUT.block_size)), LAYOUT))


def measure(rounds: int = 6, blocks: int = 32, heads: int = 1, order: str = "nhc") -> list[Cost]:
    """Save, re-save and load ``blocks`` blocks ``rounds`` times on each side, alternated; the cost of each.

    ``save``: blocks never stored before, each round (what the scheduler saves: blocks the store lacks).
    ``re-save``: the last round's blocks again (another engine saving a prefix already stored): per-rank
    frames are rewritten, canonical sections published once are kept. ``load``: the last round's blocks."""
    torch.set_num_threads(1)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        layout = dataclasses.replace(LAYOUT, block_order=order)
        sides = {f: _worker(Path(tmp) / f, f, blocks, heads, layout) for f in ("per_rank", "canonical")}
        keys = _keys(blocks, 0)
        for f in sides:
            _timed(sides[f], keys, True)
        for op in OPS:
            times: dict[str, list[float]] = {f: [] for f in sides}
            for r in range(rounds):
                turn = list(sides) if r % 4 in (0, 3) else list(sides)[::-1]  # ABBA BAAB
                fresh = _keys(blocks, r + 1) if op == "save" else keys
                for f in turn:
                    times[f].append(_timed(sides[f], fresh, op != "load"))
                keys = fresh
            ratios = tuple(c / p for c, p in zip(times["canonical"], times["per_rank"], strict=True))
            med = {f: statistics.median(t) for f, t in times.items()}
            out.append(Cost(op, heads, med["per_rank"], med["canonical"], ratios))
        for half in sides.values():
            half.shutdown()
    return out


GRIDS = ((LAYOUT.num_kv_heads, "nhc"), (1, "hnc"), (1, "nhc"))
"""What ``run`` times: one section a block; the default grid (a section a head) under ``hnc``, vLLM's CPU block
order, where a head's bytes of a layer are one run (no conversion); the default grid under ``nhc``, vLLM's GPU
order, where each is ``block_size`` runs: the conversion (a strided copy each way) is in that row."""


def run(quick: bool) -> list[BenchResult]:
    """``kvdi bench canonical``: save, re-save and load, for each of :data:`GRIDS`."""
    rounds, blocks = (4, 8) if quick else (10, 32)
    results = []
    for heads, order in GRIDS:
        for cost in measure(rounds, blocks, heads, order):
            note = (
                f"section_heads={heads}, {blocks} x 1 MiB {order} blocks on files; per round "
                f"{min(cost.ratios):.2f}-{max(cost.ratios):.2f}x, {rounds} rounds"
            )
            metric = f"{cost.op} ({'a section a block' if heads > 1 else 'a section a head'}, {order})"
            ms = (cost.canonical * 1e3, cost.per_rank * 1e3)
            target = TARGET
            row = BenchResult("canonical", metric, "ms", *ms, "per-rank frames", cost.ratio, target, note, False)
            results.append(row)
    return results


__all__ = ["GRIDS", "LAYOUT", "TARGET", "Cost", "measure", "run"]
