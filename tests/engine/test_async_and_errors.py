"""Connector behaviours beyond the synchronous store path: asynchronous loads and steps that raise."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorMetadata,
    KVRequest,
    SchedulerConnector,
    SchedulerOutput,
    WorkerConnector,
    loadable_tokens,
)
from kvdi.connectors.null import NullSchedulerConnector, NullWorkerConnector
from kvdi.containers import EngineContainer
from kvdi.engine.engine import LLMEngine
from kvdi.layout import KVCacheSpec
from kvdi.registry import ConnectorSpec
from kvdi.settings import KvdiSettings
from tests.helpers.engine import registry_with

Make = Callable[..., EngineContainer]
PROMPTS = [[(3 * i + j) % 256 for j in range(10 + 5 * i)] for i in range(3)]


@dataclass
class MemoryStore:
    """Blocks by key in host memory, shared by both halves of one engine."""

    blocks: dict[bytes, torch.Tensor] = field(default_factory=dict)


def open_memory_store(options: Any, layout: KVCacheSpec, settings: KvdiSettings) -> MemoryStore:
    return MemoryStore()


def keys_of(request: KVRequest, n: int, block_size: int) -> list[bytes]:
    prompt = request.prompt_token_ids
    return [repr((request.cache_salt, prompt[: (i + 1) * block_size])).encode() for i in range(n)]


class AsyncLoadScheduler(SchedulerConnector):
    """Offers stored blocks as an asynchronous load; saves every full prompt block once."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.store: MemoryStore = context.backend
        self.bs = context.layout.block_size
        self._loads: list[BlockTransfer] = []
        self._saved: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, bool]:
        n = loadable_tokens(len(request.prompt_token_ids), self.bs) // self.bs
        keys, hits = keys_of(request, n, self.bs), 0
        while hits < n and keys[hits] in self.store.blocks:
            hits += 1
        return hits * self.bs, hits > 0

    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        n = num_external_tokens // self.bs
        self._saved[request.request_id] = n
        if n:
            keys = tuple(keys_of(request, n, self.bs))
            self._loads.append(BlockTransfer(request.request_id, tuple(block_ids[:n]), keys))

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        saves = []
        for sched in output.scheduled:
            req = sched.request
            full = min(sched.num_computed_tokens + sched.num_scheduled_tokens, len(req.prompt_token_ids)) // self.bs
            done = self._saved.get(req.request_id, 0)
            if full > done:
                keys = tuple(keys_of(req, full, self.bs)[done:])
                saves.append(BlockTransfer(req.request_id, tuple(sched.block_ids[done:full]), keys))
                self._saved[req.request_id] = full
        meta, self._loads = BlockTransferMetadata(tuple(self._loads), tuple(saves)), []
        return meta


class AsyncLoadWorker(WorkerConnector):
    """Loads land in the cache only in ``get_finished`` (as if copied in the background).

    An engine that computed a request before its load was reported finished would read an
    empty cache and generate different tokens.
    """

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.store: MemoryStore = context.backend
        self.caches: dict[str, torch.Tensor] = {}
        self._pending: list[BlockTransfer] = []

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.caches = dict(kv_caches)

    def start_load_kv(self) -> None:
        meta = self.metadata
        assert isinstance(meta, BlockTransferMetadata)
        self._pending.extend(meta.loads)

    def wait_for_save(self) -> None:
        meta = self.metadata
        assert isinstance(meta, BlockTransferMetadata)
        names = self.context.layout.layer_names
        for transfer in meta.saves:
            for block, key in zip(transfer.block_ids, transfer.block_keys, strict=True):
                self.store.blocks[key] = torch.stack([self.caches[n][block].clone() for n in names])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for transfer in self._pending:
            for block, key in zip(transfer.block_ids, transfer.block_keys, strict=True):
                for i, name in enumerate(self.context.layout.layer_names):
                    self.caches[name][block].copy_(self.store.blocks[key][i])
        done, self._pending = {t.request_id for t in self._pending}, []
        return None, done


class FailingSaveWorker(NullWorkerConnector):
    """Raises in ``wait_for_save`` while ``broken`` is set."""

    broken = True

    def wait_for_save(self) -> None:
        if self.broken:
            raise OSError("disk on fire")


ASYNC = ConnectorSpec(
    "async_load",
    f"{__name__}:AsyncLoadScheduler",
    f"{__name__}:AsyncLoadWorker",
    backend=f"{__name__}:open_memory_store",
)
FAILING = ConnectorSpec("failing_save", "kvdi.connectors.null:NullSchedulerConnector", f"{__name__}:FailingSaveWorker")


def test_asynchronously_loaded_requests_generate_the_null_connector_tokens(make_container: Make) -> None:
    expected = make_container().engine().generate(PROMPTS, 4)
    engine = make_container(kv_connector="async_load", registry=registry_with(ASYNC)).engine()
    engine.generate(PROMPTS, 4)
    outs = engine.generate(PROMPTS, 4)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in expected]
    assert all(o.num_loaded_tokens > 0 for o in outs) and engine.block_pool.whole


def test_a_step_that_raises_fails_its_requests_and_frees_their_blocks(make_container: Make) -> None:
    engine = make_container(kv_connector="failing_save", registry=registry_with(FAILING)).engine()
    outs = engine.generate(PROMPTS, 2)
    assert all(o.error is not None and "disk on fire" in o.error for o in outs)
    assert engine.block_pool.whole


def test_the_engine_runs_on_after_a_step_raised(make_container: Make) -> None:
    engine = make_container(kv_connector="failing_save", registry=registry_with(FAILING)).engine()
    engine.generate(PROMPTS[:1], 2)
    connector = engine.worker.connector
    assert isinstance(connector, FailingSaveWorker)
    connector.broken = False
    assert engine.generate(PROMPTS[:1], 2)[0].ok


class NeverFinishesWorker(AsyncLoadWorker):
    """Neither finishes loads nor reports sends."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None


class HoldsBlocksScheduler(NullSchedulerConnector):
    def request_finished(self, request: KVRequest, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        return True, None


STUCK_LOAD = ConnectorSpec(
    "stuck_load", f"{__name__}:AsyncLoadScheduler", f"{__name__}:NeverFinishesWorker", backend=ASYNC.backend
)
STUCK_SEND = ConnectorSpec("stuck_send", f"{__name__}:HoldsBlocksScheduler", "kvdi.connectors.null:NullWorkerConnector")


def impatient_engine(container: EngineContainer) -> LLMEngine:
    return LLMEngine(container.scheduler(), container.worker(), drain_timeout_s=0.05)


def test_blocks_come_back_when_the_connector_never_reports_a_send(make_container: Make) -> None:
    engine = impatient_engine(make_container(kv_connector="stuck_send", registry=registry_with(STUCK_SEND)))
    assert all(o.ok for o in engine.generate(PROMPTS, 2))
    assert engine.block_pool.whole


def test_a_load_that_never_finishes_fails_its_request(make_container: Make) -> None:
    container = make_container(kv_connector="stuck_load", registry=registry_with(STUCK_LOAD))
    engine = impatient_engine(container)
    engine.generate(PROMPTS[:1], 1)  # stores the prompt's blocks (nothing to load yet)
    out = engine.generate(PROMPTS[:1], 1)[0]
    assert out.error is not None and "did not finish loading" in out.error
    assert engine.block_pool.whole


class BrokenLookupScheduler(NullSchedulerConnector):
    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, bool]:
        raise OSError("store unreachable")


class BrokenPlanScheduler(NullSchedulerConnector):
    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        if output.scheduled:
            raise RuntimeError("cannot plan")
        return super().build_connector_meta(output)


BROKEN_LOOKUP = ConnectorSpec(
    "broken_lookup", f"{__name__}:BrokenLookupScheduler", "kvdi.connectors.null:NullWorkerConnector"
)
BROKEN_PLAN = ConnectorSpec(
    "broken_plan", f"{__name__}:BrokenPlanScheduler", "kvdi.connectors.null:NullWorkerConnector"
)


def test_a_failed_lookup_is_a_miss_and_the_prompt_is_computed(make_container: Make) -> None:
    engine = make_container(kv_connector="broken_lookup", registry=registry_with(BROKEN_LOOKUP)).engine()
    outs = engine.generate(PROMPTS, 2)
    assert all(o.ok and o.num_computed_prompt_tokens == len(o.prompt_token_ids) for o in outs)


def test_a_connector_that_cannot_plan_a_step_fails_its_requests_and_frees_their_blocks(make_container: Make) -> None:
    engine = make_container(kv_connector="broken_plan", registry=registry_with(BROKEN_PLAN)).engine()
    outs = engine.generate(PROMPTS, 2)
    assert all(o.error is not None and "cannot plan" in o.error for o in outs)
    assert engine.block_pool.whole
