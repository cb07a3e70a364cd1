"""The p2p scheduler half: the producer plans saves of computed prompt blocks (up to the blocks a
consumer may load); the consumer offers the prefix of a prompt the producer published.

A consumer's load is remote, so under ``transfer.async_load`` (``auto`` or ``on``) it runs
beside the compute: the answer is ``load_async=True``, the load travels in
:attr:`P2pTransferMetadata.async_loads`, and the request's blocks are held (``delay_free``)
when it finishes until the worker half reports it in ``get_finished``.
``transfer.async_load=off`` loads before the step's forward pass, as ``loads``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorMetadata,
    KVRequest,
    SchedulerConnector,
    SchedulerOutput,
    loadable_tokens,
)
from kvdi.connectors.p2p.backend import require_lookups
from kvdi.connectors.store.keys import block_keys
from kvdi.connectors.store.plan import RequestPlan


@dataclass(frozen=True)
class P2pTransferMetadata(BlockTransferMetadata):
    """Block transfers of one step; ``async_loads`` complete in the background (reported by ``get_finished``)."""

    async_loads: tuple[BlockTransfer, ...] = ()


class P2pSchedulerConnector(SchedulerConnector):
    """Producer: plans saves of computed prompt blocks. Consumer: offers the blocks the producer published."""

    hit_source = "p2p"  # the tier vLLM's external_prefix_cache_hits names (vllm CacheHitSource)

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.channel = require_lookups(context)
        self._block_size = context.layout.block_size
        self.load_async = context.settings.transfer.async_load != "off"
        """Whether loads run in the background: ``transfer.async_load`` ``on``, or ``auto`` (p2p reads are remote)."""
        self._plans: dict[str, RequestPlan] = {}
        self._loads: list[BlockTransfer] = []
        self._async_loads: dict[str, BlockTransfer] = {}

    def _plan(self, request: KVRequest) -> RequestPlan:
        plan = self._plans.get(request.request_id)
        if plan is None:
            limit = loadable_tokens(len(request.prompt_token_ids), self._block_size) // self._block_size
            keys = block_keys(request.prompt_token_ids, self.context.layout, request.cache_salt)[:limit]
            plan = self._plans[request.request_id] = RequestPlan(keys)
        return plan

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self.stats.lookups += 1
        if self.channel.producer:
            return 0, False
        plan = self._plan(request)
        plan.load_from_tokens = num_computed_tokens
        held = self.channel.count_published(plan.keys)
        first = num_computed_tokens // self._block_size
        if held <= first:
            return 0, False
        self.stats.lookup_hit_blocks += held - first
        plan.load_async = self.load_async
        return held * self._block_size - num_computed_tokens, plan.load_async

    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or self.channel.producer:
            return
        plan = self._plan(request)
        start = plan.load_from_tokens // self._block_size
        end = min(start + num_external_tokens // self._block_size, len(plan.keys), len(block_ids))
        if end <= start:
            return
        transfer = BlockTransfer(request.request_id, tuple(block_ids[start:end]), tuple(plan.keys[start:end]))
        if plan.load_async:
            self._async_loads[request.request_id] = transfer
        else:
            self._loads.append(transfer)

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        loads, self._loads = tuple(self._loads), []
        async_loads = tuple(self._async_loads.values())
        self._async_loads = {}
        for transfer in async_loads:  # the worker half reports it finished: hold its blocks until then
            self._plans[transfer.request_id].held = True
        saves: list[BlockTransfer] = []
        if self.channel.producer:
            for sched in output.scheduled:
                plan = self._plan(sched.request)
                done = (sched.num_computed_tokens + sched.num_scheduled_tokens) // self._block_size
                # from block 0: the consumer loads only from the producer, whatever this engine had cached
                save = plan.take_save(sched.request.request_id, sched.block_ids, 0, done)
                if save is not None:
                    saves.append(save)
        for rid in output.finished_req_ids:
            self._plans.pop(rid, None)
        return P2pTransferMetadata(loads, tuple(saves), async_loads)

    def request_finished(self, request: KVRequest, block_ids: Sequence[int]) -> tuple[bool, None]:
        """Hold the blocks (``delay_free``) when an asynchronous load of this request reached the worker half:
        it may still be writing into them until it reports the request in ``get_finished``."""
        self._async_loads.pop(request.request_id, None)  # planned, never sent: nothing to wait for
        plan = self._plans.pop(request.request_id, None)
        return plan is not None and plan.held, None


__all__ = ["P2pSchedulerConnector", "P2pTransferMetadata"]
