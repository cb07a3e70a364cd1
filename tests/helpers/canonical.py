"""The small model of the canonical-format store tests (2 layers, 2 KV heads, 4-token blocks) and one transfer step."""

from __future__ import annotations

from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata, run_transfer_step
from kvdi.connectors.store import StoreWorkerConnector
from kvdi.connectors.store.canonical_store import part_tag
from kvdi.connectors.store.keys import block_keys
from kvdi.layout import KVCacheSpec

HEADS, LAYERS, BS = 2, 2, 4
WHOLE = KVCacheSpec("m#canonical", LAYERS, HEADS, 8, BS, "float32")
TOKENS = list(range(4 * BS + 1))
KEYS = tuple(block_keys(TOKENS, WHOLE))


def rank_layout(rank: int, tp: int = 2, heads: int = HEADS, order: str = "") -> KVCacheSpec:
    """The layout of TP rank ``rank`` of ``tp`` (all layers), as vLLM's worker reports it with format=canonical."""
    tag = part_tag(0, LAYERS, LAYERS, rank, tp, heads)
    return KVCacheSpec(f"m{tag}", LAYERS, max(1, heads // tp), 8, BS, "float32", block_order=order)


def step(half: StoreWorkerConnector, ids: tuple[int, ...], save: bool) -> set[int]:
    """Save (or load) :data:`KEYS` from (into) blocks ``ids`` in one step, flushed; the blocks that failed."""
    transfer = (BlockTransfer("r", ids, KEYS),)
    failed = run_transfer_step(half, BlockTransferMetadata(() if save else transfer, transfer if save else ()))
    half.flush()
    return failed
