"""Gives kvdi's worker half caches whose blocks are contiguous, copying through bounded scratch only when needed."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any, cast

import torch

from kvdi.connectors.base import (
    AsyncLoadMetadata,
    BlockTransfer,
    BlockTransferMetadata,
    KVConnectorMetadata,
    WorkerConnector,
)
from kvdi.connectors.store.scheduler import StoreTransferMetadata
from kvdi.integrations.vllm.views import block_rows

Round = list[BlockTransfer]  # transfers (vLLM block ids) whose blocks fit the scratch together


class LayoutBridge:
    """Gives kvdi's worker half caches whose blocks are contiguous, copying through bounded scratch only when needed.

    kvdi's store halves read and write each layer's block as one contiguous run of bytes.
    When every view from :func:`kvdi_layer_view` is contiguous (``direct``: vLLM's CPU
    backend, LBNHC, NHD layouts with blocks outermost) the worker half gets vLLM's tensors
    and nothing is copied. When each block is one run but runs lie a whole number of blocks
    apart (BLNHC, BLHNC: :func:`~kvdi.integrations.vllm.views.block_rows`) it gets byte rows
    over vLLM's memory and each step's block ids are scaled to rows, still without a copy.
    Otherwise the worker half is given a contiguous scratch cache in the views' block order,
    on vLLM's device, of at most ``max_bytes`` (``allocator.max_staging_bytes``; at least one
    block): a step's loads run in rounds that each fit it (blocks mapped to scratch slots,
    loaded, scattered into vLLM's cache), then its saves (gathered into scratch, saved).
    Through scratch every transfer is synchronous (asynchronous loads and saves of the store
    halves run within the step), and the store halves' requests are still reported as vLLM
    expects: each asynchronous load leaves a marker (an empty load of its request) in the
    step's last load round. A request whose blocks failed to load in one round loads no more
    of them in later rounds (vLLM recomputes it from its first failed block anyway).
    """

    def __init__(
        self, views: Mapping[str, torch.Tensor], worker: WorkerConnector, max_bytes: int | None = None
    ) -> None:
        self.views = dict(views)
        self.worker = worker
        self.direct = all(v.is_contiguous() for v in self.views.values())
        self.row_step = 1  # vLLM's block b is row b * row_step of the caches the worker half addresses
        registered = self.views
        rows = None if self.direct else block_rows(self.views)
        if rows is not None:  # every block one run, a whole number of blocks apart: by bytes, no copy
            registered, self.row_step = rows
            self.direct = True
        self.slot_bytes = sum(v[0].numel() * v.element_size() for v in self.views.values()) if self.views else 1
        limit = worker.context.settings.allocator.max_staging_bytes if max_bytes is None else max_bytes
        self.max_slots = max(1, limit // max(1, self.slot_bytes))
        self.scratch: dict[str, torch.Tensor] = {}
        self._template: BlockTransferMetadata | None = None  # this step's metadata, None: handed on as is
        self._markers: tuple[BlockTransfer, ...] | None = None
        self._load_rounds: list[Round] = []
        self._save_rounds: list[Round] = []
        self._errors: set[int] = set()
        worker.register_kv_caches(registered if self.direct else self._ensure_scratch(1))

    def describe(self) -> str:
        if self.row_step > 1:
            return f"zero-copy, by bytes (a block every {self.row_step} block runs: block-outermost packing)"
        if self.direct:
            return "zero-copy"
        return f"bridged through a kvdi-layout scratch cache of at most {self.max_slots} blocks (max_staging_bytes)"

    @property
    def scratch_bytes(self) -> int:
        """Device memory the scratch holds now (at most ``max_slots`` blocks)."""
        return sum(t.numel() * t.element_size() for t in self.scratch.values())

    def _ensure_scratch(self, slots: int) -> dict[str, torch.Tensor]:
        have = next(iter(self.scratch.values())).shape[0] if self.scratch else 0
        if slots > have:
            size = min(self.max_slots, max(slots, 2 * have))
            self.scratch = {}  # the old scratch goes before the new one is made
            self.scratch = {
                name: torch.empty((size, *view.shape[1:]), dtype=view.dtype, device=view.device)
                for name, view in self.views.items()
            }
            if have:
                self.worker.register_kv_caches(self.scratch)
        return self.scratch

    def _rounds(self, transfers: Sequence[BlockTransfer]) -> list[Round]:
        """``transfers`` cut into rounds of at most ``max_slots`` blocks (a transfer may span rounds)."""
        rounds: list[Round] = []
        current: Round = []
        room = self.max_slots
        for t in transfers:
            start = 0
            while start < len(t.block_ids):
                take = min(room, len(t.block_ids) - start)
                span = slice(start, start + take)
                current.append(BlockTransfer(t.request_id, t.block_ids[span], t.block_keys[span]))
                start += take
                room -= take
                if room == 0:
                    rounds.append(current)
                    current, room = [], self.max_slots
        if current:
            rounds.append(current)
        return rounds

    def _metadata(
        self,
        loads: tuple[BlockTransfer, ...],
        saves: tuple[BlockTransfer, ...],
        markers: tuple[BlockTransfer, ...],
        step: bool = False,
    ) -> KVConnectorMetadata:
        """One round's metadata (``step``: the step's bookkeeping, bound once), of the step's own type (store
        and p2p keep theirs: the worker half reads it). Prefetches at lookup go with the bookkeeping only."""
        if self._markers is None:
            return BlockTransferMetadata(loads, saves)
        store: dict[str, Any] = {}
        if isinstance(self._template, StoreTransferMetadata):
            store = {"async_save": False} if step else {"async_save": False, "prefetches": (), "prefetch_drops": ()}
        return cast(
            KVConnectorMetadata,
            replace(cast(Any, self._template), loads=loads, saves=saves, async_loads=markers, **store),
        )

    def bind(self, metadata: KVConnectorMetadata) -> KVConnectorMetadata:
        """The metadata to bind on kvdi's worker half for this step: the step's own (direct), or its
        bookkeeping only (the requests' markers, no blocks); :meth:`load` and :meth:`save` bind each round."""
        self._template, self._markers, self._load_rounds, self._save_rounds = None, None, [], []
        if self.row_step > 1 and isinstance(metadata, BlockTransferMetadata):
            return _scaled(metadata, self.row_step)
        if self.direct or not isinstance(metadata, BlockTransferMetadata):
            return metadata
        self._template = metadata
        async_loads = metadata.async_loads if isinstance(metadata, AsyncLoadMetadata) else None  # store and p2p
        if async_loads is not None:
            self._markers = tuple(BlockTransfer(t.request_id, (), ()) for t in async_loads)
        self._load_rounds = self._rounds((*metadata.loads, *(async_loads or ())))
        self._save_rounds = self._rounds(metadata.saves)
        return self._metadata((), (), self._markers or (), step=True)

    def _bind_round(self, transfers: Round, saves: bool, last: bool) -> list[tuple[int, int]]:
        """Bind one round on the worker half, its blocks mapped to scratch slots 0..n; the (block, slot) pairs."""
        pairs: list[tuple[int, int]] = []
        mapped = []
        for t in transfers:
            slots = tuple(range(len(pairs), len(pairs) + len(t.block_ids)))
            pairs.extend(zip(t.block_ids, slots, strict=True))
            mapped.append(BlockTransfer(t.request_id, slots, t.block_keys))
        self._ensure_scratch(len(pairs))
        markers = (self._markers or ()) if last and not saves else ()
        loads, stores = ((), tuple(mapped)) if saves else (tuple(mapped), ())
        self.worker.bind_connector_metadata(self._metadata(loads, stores, markers))
        return pairs

    def load(self, start: Callable[[], None]) -> None:
        """Run this step's loads (``start``: the worker half's ``start_load_kv``), round by round through
        scratch into vLLM's cache; remember the vLLM block ids that failed."""
        if self._template is None:  # direct, or a connector's own metadata: its block ids are vLLM's
            start()
            self._errors |= self._worker_errors()
            return
        rounds = self._load_rounds or ([[]] if self._markers else [])
        failed_requests: set[str] = set()
        for i, transfers in enumerate(rounds):
            live = [t for t in transfers if t.request_id not in failed_requests]
            pairs = self._bind_round(live, saves=False, last=i == len(rounds) - 1)
            start()
            failed_slots = self.worker.get_block_ids_with_load_errors()
            slot_to_block = dict((slot, block) for block, slot in pairs)
            failed = {slot_to_block.get(s, s) for s in failed_slots}
            self._errors |= failed
            failed_requests.update(t.request_id for t in live if failed.intersection(t.block_ids))
            self._copy(
                [(b, s) for b, s in pairs if s not in failed_slots and b not in self._errors], into_scratch=False
            )

    def _copy(self, pairs: Sequence[tuple[int, int]], into_scratch: bool) -> None:
        """Copy the ``(vLLM block, scratch slot)`` pairs' blocks into scratch (a save) or out of it (a load)."""
        if not pairs:
            return
        blocks = torch.tensor([b for b, _ in pairs], dtype=torch.long)
        slots = torch.tensor([s for _, s in pairs], dtype=torch.long)
        for name, view in self.views.items():
            scratch = self.scratch[name]
            at_block, at_slot = blocks.to(view.device), slots.to(scratch.device)
            if into_scratch:
                scratch[at_slot] = view[at_block]
            else:
                view[at_block] = scratch[at_slot]

    def save(self, wait: Callable[[], None]) -> None:
        """Run this step's saves (``wait``: the worker half's ``wait_for_save``), round by round: the
        blocks gathered from vLLM's cache into scratch (kvdi's byte order), then saved."""
        if self._template is None:
            wait()
            return
        for transfers in self._save_rounds:
            self._copy(self._bind_round(transfers, saves=True, last=False), into_scratch=True)
            wait()

    def take_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (with a direct cache, background loads' too)."""
        if self.direct:
            self._errors |= self._worker_errors()
        errors, self._errors = self._errors, set()
        return errors

    def _worker_errors(self) -> set[int]:
        """The worker half's failed blocks as vLLM block ids (rows back to blocks when addressed by bytes)."""
        return {b // self.row_step for b in self.worker.get_block_ids_with_load_errors()}


def _scaled(metadata: BlockTransferMetadata, step: int) -> BlockTransferMetadata:
    """``metadata`` with every transfer's vLLM block ids ``b`` as rows ``b * step`` (:func:`block_rows`)."""
    changes: dict[str, Any] = {}
    for f in fields(metadata):
        value = getattr(metadata, f.name)
        if isinstance(value, tuple) and value and all(isinstance(t, BlockTransfer) for t in value):
            changes[f.name] = tuple(
                BlockTransfer(t.request_id, tuple(b * step for b in t.block_ids), t.block_keys) for t in value
            )
    return replace(metadata, **changes)
