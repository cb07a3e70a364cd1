"""Gives kvdi's worker half caches whose blocks are contiguous, copying through scratch only when needed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import torch

from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata, KVConnectorMetadata, WorkerConnector
from kvdi.connectors.store.scheduler import StoreTransferMetadata


class LayoutBridge:
    """Gives kvdi's worker half caches whose blocks are contiguous, copying through scratch only when needed.

    kvdi's store halves read and write each layer's block as one contiguous run of bytes.
    When every view from :func:`kvdi_layer_view` has contiguous blocks (``direct``: vLLM's
    CPU backend, NHD layouts with blocks outermost) the worker half gets vLLM's tensors and
    nothing is copied. Otherwise the worker half is given a small contiguous scratch cache in
    kvdi's order: each step's :class:`BlockTransferMetadata` is rewritten from vLLM block ids
    to scratch slots, blocks to save are gathered into scratch before the save, and loaded
    blocks are scattered into vLLM's cache after the load. Through scratch every transfer is
    synchronous (asynchronous loads and saves of the store halves run within the step), and
    the store halves' requests are still reported as vLLM expects.
    """

    def __init__(self, views: Mapping[str, torch.Tensor], worker: WorkerConnector) -> None:
        self.views = dict(views)
        self.worker = worker
        self.direct = all(v.is_contiguous() for v in self.views.values())
        self.scratch: dict[str, torch.Tensor] = {}
        self._loads: list[tuple[int, int]] = []  # (vllm block id, scratch slot)
        self._saves: list[tuple[int, int]] = []
        self._slot_to_block: dict[int, int] = {}
        self._errors: set[int] = set()
        worker.register_kv_caches(self.views if self.direct else self._ensure_scratch(1))

    def _ensure_scratch(self, slots: int) -> dict[str, torch.Tensor]:
        have = next(iter(self.scratch.values())).shape[0] if self.scratch else 0
        if slots > have:
            size = max(slots, 2 * have)
            self.scratch = {
                name: torch.empty((size, *view.shape[1:]), dtype=view.dtype, device=view.device)
                for name, view in self.views.items()
            }
            if have:
                self.worker.register_kv_caches(self.scratch)
        return self.scratch

    def bind(self, metadata: KVConnectorMetadata) -> KVConnectorMetadata:
        """The metadata to hand kvdi's worker half for this step (block ids mapped to scratch slots)."""
        self._loads, self._saves, self._slot_to_block = [], [], {}
        if self.direct or not isinstance(metadata, BlockTransferMetadata):
            return metadata
        next_slot = 0

        def remap(transfers: Sequence[BlockTransfer], pairs: list[tuple[int, int]]) -> tuple[BlockTransfer, ...]:
            nonlocal next_slot
            out = []
            for t in transfers:
                slots = tuple(range(next_slot, next_slot + len(t.block_ids)))
                next_slot += len(slots)
                pairs.extend(zip(t.block_ids, slots, strict=True))
                out.append(BlockTransfer(t.request_id, slots, t.block_keys))
            return tuple(out)

        async_loads: tuple[BlockTransfer, ...] | None = getattr(metadata, "async_loads", None)  # store and p2p
        if async_loads is None:
            loads, saves = remap(metadata.loads, self._loads), remap(metadata.saves, self._saves)
            bridged: BlockTransferMetadata = BlockTransferMetadata(loads, saves)
        else:
            # Scratch slots are reused by the next step, so nothing may run in the background here: async
            # loads run now, with the sync ones, and an empty async load per request keeps the worker's
            # bookkeeping (reported finished receiving next step, its blocks held until finished sending).
            loads = remap((*metadata.loads, *async_loads), self._loads)
            saves = remap(metadata.saves, self._saves)
            markers = tuple(BlockTransfer(t.request_id, (), ()) for t in async_loads)
            sync_saves = {"async_save": False} if isinstance(metadata, StoreTransferMetadata) else {}
            bridged = replace(cast(Any, metadata), loads=loads, saves=saves, async_loads=markers, **sync_saves)
        self._slot_to_block = dict((slot, block) for block, slot in self._loads)
        if next_slot:
            self._ensure_scratch(next_slot)
        return bridged

    def after_load(self) -> None:
        """Scatter the blocks kvdi loaded into scratch into vLLM's cache; remember failed vLLM block ids."""
        failed_slots = self.worker.get_block_ids_with_load_errors()
        if self.direct:
            self._errors |= failed_slots
            return
        self._errors |= {self._slot_to_block.get(s, s) for s in failed_slots}
        good = [(b, s) for b, s in self._loads if s not in failed_slots and b not in self._errors]
        if not good:
            return
        blocks = torch.tensor([b for b, _ in good], dtype=torch.long)
        slots = torch.tensor([s for _, s in good], dtype=torch.long)
        for name, view in self.views.items():
            src = self.scratch[name]
            view[blocks.to(view.device)] = src[slots.to(src.device)]

    def before_save(self) -> None:
        """Gather the blocks to save from vLLM's cache into scratch (kvdi's byte order)."""
        if self.direct or not self._saves:
            return
        blocks = torch.tensor([b for b, _ in self._saves], dtype=torch.long)
        slots = torch.tensor([s for _, s in self._saves], dtype=torch.long)
        for name, view in self.views.items():
            dst = self.scratch[name]
            dst[slots.to(dst.device)] = view[blocks.to(view.device)]

    def take_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (with a direct cache, background loads' too)."""
        if self.direct:
            self._errors |= self.worker.get_block_ids_with_load_errors()
        errors, self._errors = self._errors, set()
        return errors
