"""The scheduler role of :class:`~.connector.KvdiConnector`: vLLM's scheduler calls, in kvdi's terms.

:class:`SchedulerSide` takes its collaborators in its constructor: kvdi's scheduler half, the
request tracker, the fleet side (:class:`~.fleet.events.SchedulerFleet`), the held saves
(:class:`~.pending.HeldSaves`), the adapter's counters, the :class:`~.block_index.BlockIndex`
of a process-local store (or None) and the half when it prefetches at lookup (or None). The
connector forwards vLLM's scheduler-role hooks here.

A step costs kvdi the same whatever the number of running requests when none can move a block: kvdi's own
halves plan only prompt blocks, so the tracker passes them only new, resumed and prompt-phase requests
(:func:`prompt_steps_only`); a step where every scheduled request decodes is not translated at all
(:meth:`RequestTracker.quiet`), and its envelope is one shared object that pickles as a small int
(:func:`.envelopes.empty_envelope`). ``docs/step-cost.md`` counts every hook's calls per step.
"""

from __future__ import annotations

from typing import Any

from kvdi.connectors.base import PrefetchingScheduler, SchedulerConnector, SchedulerOutput
from kvdi.connectors.null import NullSchedulerConnector
from kvdi.connectors.p2p.scheduler import P2pSchedulerConnector
from kvdi.connectors.store.scheduler import StoreSchedulerConnector, StoreTransferMetadata
from kvdi.integrations.vllm.async_loads import SchedulerLoads
from kvdi.integrations.vllm.block_index import BlockIndex
from kvdi.integrations.vllm.envelopes import EMPTY_INNER, KvdiConnectorMetadata, KvdiWorkerMetadata, empty_envelope
from kvdi.integrations.vllm.fleet.events import SchedulerFleet
from kvdi.integrations.vllm.fleet.stats import AdapterStats
from kvdi.integrations.vllm.hybrid import HybridScheduler
from kvdi.integrations.vllm.pending import HeldSaves
from kvdi.integrations.vllm.requests import QUIET, RequestTracker

NULL_INNER = EMPTY_INNER[2]  # a plain empty BlockTransferMetadata, as the null half builds it


class SchedulerSide:
    """vLLM's scheduler-role hooks over kvdi's scheduler half (lookups, allocation, step metadata, finished requests,
    the workers' reports)."""

    def __init__(
        self,
        half: SchedulerConnector,
        tracker: RequestTracker,
        fleet: SchedulerFleet,
        held_saves: HeldSaves,
        counts: AdapterStats,
        index: BlockIndex | None = None,
        prefetcher: PrefetchingScheduler | None = None,
    ) -> None:
        self.half = half
        self.fleet = fleet
        self.held_saves = held_saves
        self.counts = counts
        self._tracker = tracker
        tracker.prompt_only = prompt_steps_only(half)  # decoding requests cost nothing per step
        self._index = index
        self._prefetcher = prefetcher  # the half, when it prefetches at lookup (:mod:`.prefetch`)
        self._hybrid = half if isinstance(half, HybridScheduler) else None
        self._parked = SchedulerLoads()
        self._lookups = half.lookups if isinstance(half, StoreSchedulerConnector) else None  # background lookups
        self._idle_wait_s = half.context.settings.transfer.idle_load_wait_ms / 1e3
        self._null = type(half) is NullSchedulerConnector  # plans nothing: not asked on a step with nothing to pass
        self._null_envelope = empty_envelope(NULL_INNER) if self._null else None
        # A store half plans nothing while it is not due (:attr:`StoreSchedulerConnector.due`) and its load deadline
        # is off (on, every quiet step counts the rule's probes): its answer to a quiet step is this envelope's.
        self._store = half if isinstance(half, StoreSchedulerConnector) else None
        async_save = half.context.settings.transfer.async_save
        self._store_envelope = empty_envelope(StoreTransferMetadata(async_save=async_save)) if self._store else None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvdi can load beyond ``num_computed_tokens`` (vLLM's local prefix-cache hit; 0 for producers)."""
        req = self.fleet.request(request)
        n, load_async = self.half.get_num_new_matched_tokens(req, num_computed_tokens)
        if n is None:  # prefetching into host staging: vLLM asks again next step
            return None, False
        self.fleet.looked_up(req, num_computed_tokens, n)
        self._parked.offer(req.request_id, bool(load_async and n))
        return n, bool(load_async and n)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Forward the request's blocks (per KV cache group) and accepted token count to kvdi."""
        ids = blocks.get_block_ids() if blocks is not None else ([],)
        req = self._tracker.request(request)
        if self._parked.allocated(req.request_id, num_external_tokens):
            self.counts.async_load_requests += 1  # vLLM now waits for it in WAITING_FOR_REMOTE_KVS
        if self._hybrid is not None:
            self._hybrid.allocated(req, ids, num_external_tokens)
        else:
            self.half.update_state_after_alloc(req, list(ids[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvdiConnectorMetadata:
        """kvdi's metadata for this step, in vLLM's envelope: the shared one of :func:`.envelopes.empty_envelope`
        when the step moves nothing (nothing built, nothing compared when the pickle goes out). A step that passes
        no request on (:meth:`RequestTracker.quiet`) is not translated; the null half is not even asked."""
        tracker = self._tracker
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        if tracker.quiet(scheduler_output):
            if not (preempted or idle or self._parked.unheld):
                if self._null_envelope is not None:
                    return self._null_envelope  # what the null half answers for a step that schedules nothing
                store, envelope = self._store, self._store_envelope
                if store is not None and envelope is not None and not (store.due or store.deadline.enabled):
                    return envelope  # what the store half answers for a step that schedules nothing, unasked
            output = SchedulerOutput(tracker.step, (), QUIET.finished_req_ids)
        else:
            output = tracker.translate_busy(scheduler_output)
            if self._parked.parked:
                self._parked.scheduled(s.request.request_id for s in output.scheduled)
        inner = NULL_INNER if self._null and not output.scheduled else self.half.build_connector_meta(output)
        if output.finished_req_ids or self.fleet.events_on:
            self.fleet.planned(inner, output.finished_req_ids)
        if idle and self._lookups is not None and self._idle_wait_s and self._lookups.pending:
            self._lookups.wait(self._idle_wait_s)  # nothing runs: wait for an answer (GIL released), not spin
        if not (preempted or idle or self._parked.unheld):
            shared = empty_envelope(inner)
            if shared is not None:
                return shared
        ids = tuple(str(r) for r in preempted or ())
        return KvdiConnectorMetadata(inner, ids, self._parked.take_unheld(), idle)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Tell kvdi the request ended; returns kvdi's (delay_free, kv_transfer_params)."""
        req = self._tracker.request(request)
        try:
            delay_free, params = self.half.request_finished(req, list(block_ids))
        finally:
            self._tracker.forget(req.request_id)
        # Ended while parked for its asynchronous load: vLLM holds the blocks until finished receiving.
        return self.held_saves.finished(req.request_id, self._parked.finished(req.request_id, delay_free)), params

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' report: events for routers, finished prefetches, sent saves, stored and vanished keys
        (a report of none of them: nothing to do)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        events = getattr(connector_output, "kv_cache_events", None)
        sent = getattr(connector_output, "finished_sending", None)
        if not (meta or events or sent or getattr(connector_output, "failed_recving", None)):
            return
        self.fleet.worker_events(connector_output)
        self._prefetch_reported(meta.prefetched if isinstance(meta, KvdiWorkerMetadata) else ())
        self.held_saves.sent(sent)
        if self._hybrid is not None:  # recomputed from scratch: store them again
            self._hybrid.load_failed(getattr(connector_output, "failed_recving", None) or ())
        if self._index is not None and isinstance(meta, KvdiWorkerMetadata):
            self._index.add(meta.stored)
            for key in meta.dropped:
                self._index.discard(key)

    def _prefetch_reported(self, reports: tuple[tuple[str, int], ...]) -> None:
        """The worker's finished prefetches, ``(request, leading blocks staged)``."""
        if reports and self._prefetcher is not None:
            self._prefetcher.prefetched(reports)
            self.counts.prefetch_reported += len(reports)
            self.counts.prefetch_staged_blocks += sum(n for _, n in reports)

    def has_pending_push_work(self) -> bool:
        """Held saves still to be reported, or prefetch staging of ended requests still to be dropped."""
        if self._prefetcher is None:
            return bool(self.held_saves.held)
        prefetch = self._prefetcher.prefetch if self._prefetcher is not None else None
        return self.held_saves.pending_push_work(bool(prefetch is not None and prefetch.drops_due))


def prompt_steps_only(half: SchedulerConnector) -> bool:
    """Whether ``half`` plans transfers of prompt blocks only, so the :class:`RequestTracker` passes on only the
    requests that can still move a block (:attr:`RequestTracker.prompt_only`): kvdi's store, p2p, null and hybrid
    scheduler halves and their subclasses. Any other half sees every scheduled request every step, as before."""
    return isinstance(half, (StoreSchedulerConnector, P2pSchedulerConnector, NullSchedulerConnector, HybridScheduler))


__all__ = ["SchedulerSide", "prompt_steps_only"]
