"""kvdi's halves for a model with several KV cache groups (vLLM's hybrid KV cache manager; vLLM-free).

:class:`HybridScheduler` plans per group (:mod:`.groups`): it offers the longest prefix every
group can serve, loads each group's blocks into that group's block ids, and stores only the
blocks a group needs (a sliding window's in-window blocks, a Mamba group's boundary state).
:class:`HybridWorker` hands each group's transfers to that group's own store worker half, which
copies only the group's layers under keys and frames of the group's layout.

vLLM cannot map a block id to a request when several groups share ids, so with more than one
group every load is asynchronous and a failed load is reported per request
(:meth:`HybridWorker.take_failed`, vLLM's ``failed_recving``): vLLM then recomputes the request.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvdi.connectors.base import (
    BlockTransfer,
    ConnectorContext,
    KVConnectorMetadata,
    KVRequest,
    PreemptionAware,
    SchedulerConnector,
    SchedulerOutput,
    WorkerConnector,
    loadable_tokens,
)
from kvdi.connectors.store.keys import block_keys
from kvdi.connectors.store.scheduler import StoreTransferMetadata
from kvdi.integrations.vllm.bridge import LayoutBridge
from kvdi.integrations.vllm.groups import GroupSpec, best_boundary, group_layout, hit_unit
from kvdi.integrations.vllm.layout import kvdi_layer_view
from kvdi.integrations.vllm.parallel import KeyLookup, RankSlice
from kvdi.integrations.vllm.requests import RequestTracker
from kvdi.integrations.vllm.views import page_view
from kvdi.layout import KVCacheSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HybridMetadata(KVConnectorMetadata):
    """One step's transfers, one :class:`StoreTransferMetadata` per KV cache group (block ids of that group)."""

    groups: tuple[StoreTransferMetadata, ...]


@dataclass
class _Plan:
    keys: list[list[bytes]]  # per group
    saved: list[int]  # per group: blocks below this are stored or considered
    load: tuple[int, int] | None = None  # offered: (local tokens, boundary tokens)
    held: bool = False


@dataclass
class _Pending:
    """Worker side, per request: groups yet to report it, and whether any group's load failed."""

    loading: set[int] = field(default_factory=set)
    holding: set[int] = field(default_factory=set)
    blocks: dict[int, set[int]] = field(default_factory=dict)
    failed: bool = False


class HybridScheduler(SchedulerConnector):
    """Scheduler half over several KV cache groups: per-group keys, hits, loads and saves."""

    def __init__(
        self,
        context: ConnectorContext,
        groups: Sequence[GroupSpec],
        layouts: Sequence[KVCacheSpec],
        stores: Sequence[KeyLookup],
        tracker: RequestTracker,
        release: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(context)
        self._release = release
        self.groups, self.layouts, self.stores = tuple(groups), tuple(layouts), tuple(stores)
        self.tracker = tracker
        self.unit = hit_unit(self.groups)
        self._plans: dict[str, _Plan] = {}
        self._async_loads: dict[str, list[BlockTransfer]] = {}

    def _plan(self, request: KVRequest) -> _Plan:
        plan = self._plans.get(request.request_id)
        if plan is None:
            keys = [block_keys(request.prompt_token_ids, layout, request.cache_salt) for layout in self.layouts]
            plan = self._plans[request.request_id] = _Plan(keys, [0] * len(self.groups))
        return plan

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self.stats.lookups += 1
        plan = self._plan(request)
        plan.load = None
        if not self.context.settings.is_consumer:
            return 0, False
        limit = loadable_tokens(len(request.prompt_token_ids), self.unit)
        try:
            boundary = best_boundary(self.groups, plan.keys, self._count_prefix, num_computed_tokens, limit)
        except Exception:  # anything a store raises is a miss
            self.stats.load_failures += 1
            return 0, False
        if boundary <= num_computed_tokens:
            return 0, False
        self.stats.lookup_hit_blocks += (boundary - num_computed_tokens) // self.unit
        plan.load = (num_computed_tokens, boundary)
        return boundary - num_computed_tokens, True  # several groups: only per-request failures reach vLLM

    def _count_prefix(self, group: int, keys: Sequence[bytes]) -> int:
        n = self.stores[group].count_prefix(keys)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise TypeError(f"count_prefix returned {n!r}")
        return n

    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """kvdi's single-list form: ``block_ids`` are the first group's (others load nothing); see :meth:`allocated`."""
        self.allocated(request, (list(block_ids),), num_external_tokens)

    def allocated(self, request: KVRequest, group_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        """vLLM allocated ``group_ids`` (one list per group) and accepted ``num_external_tokens``."""
        plan = self._plans.get(request.request_id)
        if plan is None or plan.load is None:
            return
        local, boundary = plan.load
        plan.load = None
        if num_external_tokens <= 0:
            return
        boundary = min(boundary, local + num_external_tokens)
        transfers = []
        for g, group in enumerate(self.groups):
            ids = group_ids[g] if g < len(group_ids) else ()
            span = [i for i in group.to_load(local // group.block_size, boundary // group.block_size) if i < len(ids)]
            transfers.append(_transfer(request.request_id, ids, plan.keys[g], span))
            plan.saved[g] = max(plan.saved[g], boundary // group.block_size)
        self._async_loads[request.request_id] = transfers

    def build_connector_meta(self, output: SchedulerOutput) -> HybridMetadata:
        n = len(self.groups)
        loads: list[list[BlockTransfer]] = [[] for _ in range(n)]
        saves: list[list[BlockTransfer]] = [[] for _ in range(n)]
        async_save = self.context.settings.transfer.async_save
        for rid, transfers in self._async_loads.items():
            self._plans[rid].held = True
            for g, t in enumerate(transfers):
                loads[g].append(t)
        self._async_loads = {}
        if self.context.settings.is_producer:
            for sched in output.scheduled:
                plan, rid = self._plan(sched.request), sched.request.request_id
                prompt = len(sched.request.prompt_token_ids)
                done = min(sched.num_computed_tokens + sched.num_scheduled_tokens, prompt)
                group_ids = self.tracker.groups.get(rid, [])
                for g, group in enumerate(self.groups):
                    ids, keys, bs = group_ids[g] if g < len(group_ids) else [], plan.keys[g], group.block_size
                    start = max(plan.saved[g], sched.num_computed_tokens // bs)
                    end = min(done // bs, len(ids), len(keys))
                    plan.saved[g] = max(plan.saved[g], end)
                    picked = group.to_save(start, end, prompt) if end > start else []
                    if picked:
                        saves[g].append(_transfer(rid, ids, keys, picked))
                        plan.held = plan.held or async_save
        for rid in output.finished_req_ids:
            self._plans.pop(rid, None)
        return HybridMetadata(
            tuple(StoreTransferMetadata((), tuple(saves[g]), tuple(loads[g]), async_save) for g in range(n))
        )

    def load_failed(self, request_ids: Collection[str]) -> None:
        """vLLM recomputes these requests from scratch: store their blocks again as they are recomputed."""
        for rid in request_ids:
            plan = self._plans.get(rid)
            if plan is not None:
                plan.saved = [0] * len(self.groups)

    def request_finished(self, request: KVRequest, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        self._async_loads.pop(request.request_id, None)
        plan = self._plans.pop(request.request_id, None)
        return plan is not None and plan.held, None

    def shutdown(self) -> None:
        """Release the groups' containers."""
        if self._release is not None:
            self._release()
            self._release = None


def group_layouts(
    layout: KVCacheSpec, groups: Sequence[GroupSpec], shape: RankSlice, worker: bool
) -> list[KVCacheSpec]:
    """Each group's layout (:func:`~kvdi.integrations.vllm.groups.group_layout` of ``layout``).

    With canonical sections (``shape.canonical``) the scheduler's layout of an attention group has the whole
    model's KV heads, as ``layout`` has them, not vLLM's per-rank count: block keys derive from it, so every
    TP shape names a group's blocks alike (docs/stored-format.md#hybrid-models)."""
    layouts = [group_layout(layout, g) for g in groups]
    if shape.canonical is None or worker:
        return layouts
    return [lay if lay.page_bytes else replace(lay, num_kv_heads=layout.num_kv_heads) for lay in layouts]


def group_view(cache: Any, layout: KVCacheSpec, num_blocks: int | None) -> torch.Tensor:
    """One layer of one group as ``view[block_id]``: attention as :func:`kvdi_layer_view`; a Mamba layer's
    state tensors (views into one page per block) as the raw ``[num_blocks, page_bytes]`` bytes of its pages
    (:func:`~kvdi.integrations.vllm.views.page_view`)."""
    if not layout.page_bytes:
        return kvdi_layer_view(cache, layout, num_blocks)
    return page_view(cache, layout.page_bytes)


def _transfer(request_id: str, ids: Sequence[int], keys: Sequence[bytes], picked: Sequence[int]) -> BlockTransfer:
    return BlockTransfer(request_id, tuple(ids[i] for i in picked), tuple(keys[i] for i in picked))


class HybridWorker(WorkerConnector):
    """Worker half over several KV cache groups: one store worker half per group, reported per request."""

    def __init__(
        self,
        context: ConnectorContext,
        groups: Sequence[GroupSpec],
        halves: Sequence[WorkerConnector],
        shape: RankSlice,
        release: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(context)
        self._release = release
        self.groups, self.halves, self.shape = tuple(groups), tuple(halves), shape
        self._pending: dict[str, _Pending] = {}
        self._failed: set[str] = set()
        self.saved_blocks = [0] * len(self.groups)
        self.bridges: list[LayoutBridge] = []

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """``kv_caches`` by vLLM layer name; each group's half gets its own layers as ``layers.<i>``."""
        self.register_vllm_caches(kv_caches, None)

    def register_vllm_caches(self, kv_caches: Mapping[str, Any], num_blocks: int | None) -> None:
        """vLLM's per-layer caches (groups overlay the same memory): each group's half gets block views of its
        own layers, addressed by that group's block ids (:func:`group_view`), through its own
        :class:`LayoutBridge`: zero-copy where the group's blocks are contiguous, else bounded scratch. The
        groups that need scratch share ``allocator.max_staging_bytes`` evenly."""
        per_group = [
            {
                f"layers.{i}": group_view(kv_caches[name], half.context.layout, num_blocks)
                for i, name in enumerate(group.layer_names)
            }
            for group, half in zip(self.groups, self.halves, strict=True)
        ]
        bridged = sum(1 for views in per_group if not all(v.is_contiguous() for v in views.values()))
        budget = self.context.settings.allocator.max_staging_bytes // max(1, bridged)
        self.bridges = []  # the old bridges' scratch goes before the new is made
        self.bridges = [LayoutBridge(views, half, budget) for views, half in zip(per_group, self.halves, strict=True)]

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        if not isinstance(metadata, HybridMetadata):
            return
        for g, (half, meta) in enumerate(zip(self.halves, metadata.groups, strict=True)):
            for t in meta.async_loads:
                p = self._pending.setdefault(t.request_id, _Pending())
                p.loading.add(g)
                p.holding.add(g)
                p.blocks[g] = set(t.block_ids)
            if meta.async_save:
                for t in meta.saves:
                    self._pending.setdefault(t.request_id, _Pending()).holding.add(g)
            bound = self.shape.rekey(meta) if self.shape.sliced else meta
            half.bind_connector_metadata(self.bridges[g].bind(bound) if self.bridges else bound)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for half in self.halves:
            half.clear_connector_metadata()

    def start_load_kv(self) -> None:
        for g, half in enumerate(self.halves):
            if self.bridges:
                self.bridges[g].load(half.start_load_kv)  # through scratch: round by round
            else:
                half.start_load_kv()
        self._collect_errors()

    def _collect_errors(self) -> None:
        for g, half in enumerate(self.halves):
            errors = self.bridges[g].take_errors() if self.bridges else half.get_block_ids_with_load_errors()
            if not errors:
                continue
            for p in self._pending.values():
                if p.blocks.get(g, set()) & errors:
                    p.failed = True

    def wait_for_save(self) -> None:
        for g, half in enumerate(self.halves):
            before = half.stats.saved_blocks
            if self.bridges:
                self.bridges[g].save(half.wait_for_save)  # through scratch: round by round
            else:
                half.wait_for_save()
            self.saved_blocks[g] += half.stats.saved_blocks - before
        self._sum_stats()

    def handle_preemptions(self, preempted_req_ids: Collection[str] | None = None) -> None:
        for half in self.halves:
            if isinstance(half, PreemptionAware):
                half.handle_preemptions(preempted_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """A request is reported once every group that had its transfers reported it."""
        sending: set[str] = set()
        recving: set[str] = set()
        for g, half in enumerate(self.halves):
            send, recv = half.get_finished(finished_req_ids)
            for rid in recv or ():
                p = self._pending.get(rid)
                if p is not None and g in p.loading:
                    p.loading.discard(g)
                    if not p.loading:
                        recving.add(rid)
            for rid in send or ():
                p = self._pending.get(rid)
                if p is not None and g in p.holding:
                    p.holding.discard(g)
                    if not p.holding:
                        sending.add(rid)
        self._collect_errors()
        for rid in recving:
            p = self._pending[rid]
            p.blocks.clear()
            if p.failed:
                self._failed.add(rid)
                p.failed = False
        for rid in sending:
            if not self._pending[rid].loading:
                del self._pending[rid]
        self._sum_stats()
        return sending or None, recving or None

    def take_failed(self, recving: Collection[str]) -> set[str]:
        """Of the requests reported finished receiving now, those whose load failed in some group."""
        failed = self._failed & set(recving)
        self._failed -= failed
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # several groups share block ids: failures go out per request (take_failed)

    def _sum_stats(self) -> None:
        total = self.halves[0].stats
        for half in self.halves[1:]:
            total = total.merge(half.stats)
        for name, value in total.as_dict().items():
            setattr(self.stats, name, value)

    def shutdown(self) -> None:
        """Shut each group's half down (queued transfers finish), then release the groups' containers."""
        try:
            for half in self.halves:
                half.shutdown()
        finally:
            if self._release is not None:
                self._release()
                self._release = None


__all__ = ["HybridMetadata", "HybridScheduler", "HybridWorker", "group_layouts"]
