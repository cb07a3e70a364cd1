"""Helpers shared by the store connector tests: small layouts, real caches, one engine step by hand."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvdi.connectors.base import (
    ConnectorContext,
    KVConnectorRole,
    KVRequest,
    ScheduledRequest,
    SchedulerOutput,
    run_transfer_step,
)
from kvdi.connectors.store import BlockStore, StoreSchedulerConnector, StoreTransferMetadata, StoreWorkerConnector
from kvdi.layout import KVCacheSpec
from kvdi.settings import KvdiSettings


def small_layout(block_size: int = 4, dtype: str = "float32", num_layers: int = 2, model_id: str = "t") -> KVCacheSpec:
    return KVCacheSpec(model_id, num_layers, 2, 8, block_size, dtype)


def make_settings(tmp: Path | None = None, role: str = "kv_both", **kw: Any) -> KvdiSettings:
    if tmp is not None:
        kw.setdefault("shared_storage", {"path": str(tmp)})
    return KvdiSettings(kv_role=role, engine_id="test", **kw)


def make_caches(layout: KVCacheSpec, num_blocks: int = 16, seed: int | None = None) -> dict[str, torch.Tensor]:
    dtype = getattr(torch, layout.dtype)
    shape = (num_blocks, *layout.block_shape)
    if seed is None:
        return {n: torch.zeros(shape, dtype=dtype) for n in layout.layer_names}
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen).to(dtype) for n in layout.layer_names}


@dataclass
class Engine:
    """One engine's connector halves over a shared store, driven step by step like the reference engine."""

    store: BlockStore
    layout: KVCacheSpec
    settings: KvdiSettings
    num_blocks: int = 16
    seed: int | None = None
    io_thread: bool | None = False
    caches: dict[str, torch.Tensor] = field(init=False)
    scheduler: StoreSchedulerConnector = field(init=False)
    worker: StoreWorkerConnector = field(init=False)
    steps: int = 0

    def __post_init__(self) -> None:
        def ctx(role: KVConnectorRole) -> ConnectorContext:
            return ConnectorContext("test_store", role, self.settings, self.layout, None, self.store)

        self.scheduler = StoreSchedulerConnector(ctx(KVConnectorRole.SCHEDULER))
        self.worker = StoreWorkerConnector(ctx(KVConnectorRole.WORKER))
        self.worker.io_thread = self.io_thread
        self.caches = make_caches(self.layout, self.num_blocks, self.seed)
        self.worker.register_kv_caches(self.caches)

    def step(self, request: KVRequest, block_ids: tuple[int, ...]) -> StoreTransferMetadata:
        """Plan and run one prefill step of ``request`` on both halves by hand, without flushing (asynchronous
        saves stay queued, the request stays running); returns the step's metadata."""
        n, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        self.scheduler.update_state_after_alloc(request, block_ids, n or 0)
        self.steps += 1
        sched = ScheduledRequest(request, block_ids, n or 0, len(request.prompt_token_ids) - (n or 0))
        meta = self.scheduler.build_connector_meta(SchedulerOutput(self.steps, (sched,)))
        assert isinstance(meta, StoreTransferMetadata)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv()
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        return meta

    def prefill(self, request: KVRequest, block_ids: tuple[int, ...]) -> tuple[int, set[int]]:
        """Look up, load and save one whole prompt in one step; returns (loaded tokens, blocks with load errors)."""
        n, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        self.scheduler.update_state_after_alloc(request, block_ids, n)
        sched = ScheduledRequest(request, block_ids, n, len(request.prompt_token_ids) - n)
        self.steps += 1
        meta = self.scheduler.build_connector_meta(SchedulerOutput(self.steps, (sched,)))
        errors = run_transfer_step(self.worker, meta)
        self.worker.flush()  # asynchronous saves: stored (and counted) before the next engine looks
        self.scheduler.request_finished(request, block_ids)
        return n, errors

    def block(self, block_id: int) -> list[torch.Tensor]:
        return [c[block_id].clone() for c in self.caches.values()]


def request(tokens: range | list[int], rid: str = "r", salt: str | None = None) -> KVRequest:
    return KVRequest(rid, tuple(tokens), salt)


class DictStore:
    """The smallest real BlockStore: a dict, protocol methods only (no get_into_many), so the halves take their fallback."""

    def __init__(self) -> None:
        self.objects: dict[bytes, bytes] = {}

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.objects:
            n += 1
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        return [self.objects.get(k) for k in keys]

    def put_many(self, items: Sequence[tuple[bytes, Sequence[bytes | bytearray | memoryview]]]) -> int:
        for key, pieces in items:
            self.objects[key] = b"".join(bytes(p) for p in pieces)
        return len(items)

    def discard(self, key: bytes) -> None:
        self.objects.pop(key, None)

    def close(self) -> None:
        self.objects.clear()
