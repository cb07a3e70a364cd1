"""The scheduler half of the store connectors: offers stored prefixes, plans loads and saves.

It asks the store how many blocks of a prompt it holds from vLLM's local hit onward and tells the worker half,
step by step, which blocks to load and which to save (:class:`StoreTransferMetadata`).
With ``transfer.async_load`` a load runs beside the compute: the answer is
``load_async=True`` and the load travels in ``async_loads`` with the blocks allocated for
it. With ``transfer.async_save`` (or an asynchronous load) a finished request's blocks are
held (``delay_free=True``) until the worker half reports it in ``get_finished``.
With ``scheduler.load_deadline`` a lookup, a hit and a prefetch pass the cost model's rule first (:mod:`.deadline`).

A step that schedules and finishes nothing (the vLLM adapter's decode step where no request can move a block), after
no lookup, allocation or finished request since the last plan, answers a shared empty metadata at once: no lookup is
queued to flush, no prefetch to send, and the prefill rate's sample is taken only when it counts (the previous step
scheduled :data:`~.deadline_estimates.MIN_STEP_TOKENS` or more, or the rule is on and may have probes to count).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

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
from kvdi.connectors.logging_once import log_once
from kvdi.connectors.store.deadline import MIN_STEP_TOKENS, DeadlineRule, DeadlineStats
from kvdi.connectors.store.deadline_loads import LoadDeadlines
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.keys import block_keys
from kvdi.connectors.store.load_policy import ASYNC_LOAD_MIN_BYTES, AUTO_PREFETCH_LOOKUP_S, LoadPolicy
from kvdi.connectors.store.lookups import AsyncLookups
from kvdi.connectors.store.plan import RecentSaves, RequestPlan
from kvdi.connectors.store.prefetch import ASK_AGAIN, PrefetchPlanner
from kvdi.connectors.store.protocol import require_store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreTransferMetadata(BlockTransferMetadata):
    """Block transfers of one step; ``async_loads`` complete in the background (reported by ``get_finished``)."""

    async_loads: tuple[BlockTransfer, ...] = ()
    async_save: bool = False
    prefetches: tuple[BlockTransfer, ...] = ()  # keys to fetch into host staging (:mod:`.prefetch`)
    prefetch_drops: tuple[str, ...] = ()  # requests whose staging is of no more use
    load_cancels: tuple[str, ...] = ()  # background loads past their deadline: abandoned (:mod:`.deadline_loads`)


_NOTHING = (StoreTransferMetadata(), StoreTransferMetadata(async_save=True))  # a step that moves nothing, by async_save


class StoreSchedulerConnector(SchedulerConnector):
    """Offers the leading stored blocks of a prompt (consumers) and plans saves of new ones (producers)."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.store = require_store(context)
        self.stats: DeadlineStats = DeadlineStats()  # with the load deadline's counters (:mod:`.deadline`)
        self._block_size = context.layout.block_size
        self._block_bytes = context.layout.block_bytes
        self._transfer = context.settings.transfer
        self._plans: dict[str, RequestPlan] = {}
        self._async_loads: dict[str, BlockTransfer] = {}
        self._recent = RecentSaves()
        self.load_policy = LoadPolicy(self._transfer, self.store, self._block_bytes)  # sync, background, prefetch
        self.prefetch: PrefetchPlanner | None = None  # set by a host that relays the worker's reports
        self._logged: set[str] = set()  # lookup failures: a warning per reason a minute (log_once)
        self.lookups: AsyncLookups | None = None  # background lookups, set by a host that asks again
        scheduler = context.settings.scheduler
        self.deadline = DeadlineRule(self.store, self.name, self.stats, enabled=scheduler.load_deadline,
                                     margin=scheduler.load_deadline_margin)  # fmt: skip
        self._recompute: set[str] = set()  # requests whose prefetch overran its deadline: they compute
        self.load_deadlines = LoadDeadlines(self._block_size, self._block_bytes)  # background loads' deadlines
        # The next plan has work (a lookup, an allocation or a finished request since the last plan, or the last
        # step's prefill sample to close): while False, a step that schedules and finishes nothing plans nothing.
        self.due = True

    def enable_lookups(self, unavailable: str | None = None) -> bool:
        """Called once by a host that asks again after a ``None`` answer (the vLLM adapter), with why lookups cannot
        leave the scheduler's step there (None: they can); True when they run in the background from now on, as
        ``scheduler.lookup`` and the load policy decide (:meth:`~.load_policy.LoadPolicy.decide_lookup`)."""
        scheduler = self.context.settings.scheduler
        if self.load_policy.decide_lookup(scheduler.lookup, unavailable) and self.lookups is None:
            self.lookups = AsyncLookups(self.store, self.name, timeout_s=scheduler.lookup_timeout_s,
                                        on_round_trip=self.deadline.answered)  # fmt: skip
            self.deadline.start()  # a remote store's round trip, probed before the first request (rule on only)
        return self.lookups is not None

    def enable_prefetch(self, unavailable: str | None = None) -> bool:
        """Called once by a host that relays :meth:`prefetched` reports (the vLLM adapter), with why prefetch cannot
        run there (None: it can); True when lookups prefetch into host staging from now on, as the load policy
        decides (:meth:`~.load_policy.LoadPolicy.decide_prefetch`)."""
        if self.load_policy.decide_prefetch(unavailable) and self.prefetch is None:
            frame, timeout = self._block_bytes + HEADER_SIZE, self._transfer.prefetch_timeout_s
            rule = self.deadline
            self.prefetch = PrefetchPlanner(self._transfer.prefetch_max_bytes, frame, timeout, rule.loaded, rule.clock)
        return self.prefetch is not None

    @property
    def lookup_s(self) -> float | None:
        """The store's lookup round trip in seconds, once the load policy measured it (``auto``)."""
        return self.load_policy.lookup_s

    def prefetched(self, reports: Iterable[tuple[str, int]]) -> None:
        """The worker half's reports of finished prefetches: ``(request, leading blocks staged)``."""
        if self.prefetch is not None:
            self.prefetch.reported(reports)

    def _plan(self, request: KVRequest) -> RequestPlan:
        plan = self._plans.get(request.request_id)
        if plan is None:
            keys = block_keys(request.prompt_token_ids, self.context.layout, request.cache_salt)
            plan = self._plans[request.request_id] = RequestPlan(keys)
        return plan

    def load_async(self, num_blocks: int) -> bool:
        """Whether a hit of ``num_blocks`` loads asynchronously under ``transfer.async_load`` (the load policy)."""
        return self.load_policy.background(num_blocks)

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens to load beyond ``num_computed_tokens`` and whether the load is asynchronous; with prefetch,
        ``(None, False)`` (ask again) while the hit is fetched into host staging, then a synchronous load
        of exactly the blocks that arrived (no second lookup in the store)."""
        self.due = True  # it may queue a lookup or a prefetch, or release staging: the next plan sends them
        if request.request_id in self._recompute:
            return 0, False  # its prefetch overran its deadline: it computes
        if self.prefetch is not None:
            first = num_computed_tokens // self._block_size
            overran = self.prefetch.past_deadline(request.request_id, self._prefetch_deadline)
            if overran is not None:
                self.prefetch.release(request.request_id)  # the worker drops its staging: late bytes never land
                self._recompute.add(request.request_id)
                self.deadline.overran("prefetch", len(request.prompt_token_ids) - num_computed_tokens, overran)
                return 0, False
            ready = self.prefetch.ready(request.request_id, first)
            if ready is ASK_AGAIN:
                return None, False  # "ask again": the request waits a step
            if ready >= 0:
                plan = self._plan(request)
                plan.load_accepted, plan.load_async = False, False
                plan.load_from_tokens, plan.load_start, plan.load_end = num_computed_tokens, first, ready
                return max(0, ready * self._block_size - num_computed_tokens), False
        looked = self._lookup(request, num_computed_tokens)
        if looked is None:
            return None, False  # "ask again": the store is asked in the background (:mod:`.lookups`)
        n, load_async = looked
        if self.prefetch is not None and n:
            plan = self._plans[request.request_id]
            if self.prefetch.start(request.request_id, plan.load_start, plan.keys[plan.load_start : plan.load_end]):
                plan.load_start = plan.load_end = 0
                return None, False
        return n, load_async

    def _prefetch_deadline(self, blocks: int) -> float:
        """How long a prefetch of ``blocks`` may run (:meth:`~.deadline.DeadlineRule.deadline_s`, as of now)."""
        return self.deadline.deadline_s(blocks * self._block_size, blocks * self._block_bytes)

    def _lookup(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, bool] | None:
        """The hit offered (tokens, asynchronously?), or None while a background lookup runs (ask again)."""
        plan = self._plan(request)
        plan.load_accepted = plan.load_async = False
        plan.load_start = plan.load_end = 0
        bs = self._block_size
        first = min(num_computed_tokens // bs, len(plan.keys))
        loadable = min(loadable_tokens(len(request.prompt_token_ids), bs) // bs, len(plan.keys))
        uncached = len(request.prompt_token_ids) - num_computed_tokens
        best = (loadable - first) * self._block_bytes  # the bytes of a whole hit: the best a lookup can find
        asked = self.lookups is not None and self.lookups.asked(request.request_id, first, plan.keys[first:])
        if first < loadable and plan.looked_up_at != first and not asked and self.deadline.skip_lookup(uncached, best):
            return 0, False  # its round trip and even a whole hit's load cost more than recomputing the request
        if first < loadable and plan.looked_up_at != first and self.lookups is not None:
            held = self._answered(request.request_id, first, plan.keys[first:], uncached)
            if held is None:
                return None
            plan.stored, plan.looked_up_at = first + held, first
        self.stats.lookups += 1
        if first >= loadable:
            # vLLM holds every loadable block: no store round trip. The full block holding the last prompt token
            # (computed anyway) is saved again only when this half did not plan its save lately.
            plan.stored = self._recent.count_from(plan.keys, first)
        elif plan.looked_up_at != first:
            # From vLLM's local hit onward: the engine holds the blocks before it, and the keys chain from
            # block 0, so a held key at ``first`` is the same prefix whether or not the store kept the earlier ones.
            # Blocks before the local hit are never saved by this request (computed before it).
            plan.stored = first + self._count_stored(plan.keys[first:])
            plan.looked_up_at = first  # asked again while it waits for a step: this answer stands
        plan.saved = max(plan.saved, plan.stored)  # all full blocks: none is saved twice
        stored = min(plan.stored, loadable)
        if not self.context.settings.is_consumer or stored * bs <= num_computed_tokens:
            return 0, False
        if not self.deadline.offer(stored * bs - num_computed_tokens, (stored - first) * self._block_bytes):
            return 0, False  # loading it is expected to cost more than recomputing it
        self.stats.lookup_hit_blocks += stored - first
        plan.load_from_tokens, plan.load_start, plan.load_end = num_computed_tokens, first, stored
        plan.load_async = self.load_async(stored - first)
        return stored * bs - num_computed_tokens, plan.load_async

    def _answered(self, request_id: str, first: int, keys: list[bytes], uncached: int) -> int | None:
        """The background lookup's leading held ``keys`` (a failed one a counted miss, one past its deadline a
        counted deadline recompute); None while it runs."""
        assert self.lookups is not None
        lookup = self.lookups.answer(request_id, first, keys, self.deadline.deadline_s(uncached))
        if lookup is None:
            return None
        if lookup.overran is not None and not lookup.counted:
            lookup.counted = True
            self.deadline.overran("lookup", uncached, lookup.overran)
        if lookup.failure is not None and not lookup.counted:
            lookup.counted = True
            self.stats.load_failures += 1
            log_once(logger, self._logged, "lookup:background",
                     "kv connector %r: background store lookup failed, treating as a miss: %s", self.name,
                     lookup.failure)  # fmt: skip
        return lookup.answer

    def _count_stored(self, keys: list[bytes]) -> int:
        """Leading ``keys`` the store holds; anything odd (an exception, a bad reply) is a counted miss."""
        try:
            start = time.perf_counter()
            stored = self.store.count_prefix(keys)
            self.deadline.answered(time.perf_counter() - start)
        except Exception as exc:  # anything a store raises is a miss
            self.stats.load_failures += 1
            log_once(logger, self._logged, f"lookup:{type(exc).__name__}",
                     "kv connector %r: store lookup failed, treating as a miss: %r", self.name, exc)  # fmt: skip
            return 0
        if isinstance(stored, bool) or not isinstance(stored, int) or stored < 0:
            logger.warning("kv connector %r: count_prefix returned %r, treating as a miss", self.name, stored)
            self.stats.load_failures += 1
            return 0
        return min(stored, len(keys))

    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self.due = True
        plan = self._plans.get(request.request_id)
        if plan is not None:
            plan.looked_up_at = -1  # scheduled: a lookup after a preemption asks the store again, once
        if plan is None or plan.load_end <= plan.load_start:
            return
        if num_external_tokens <= 0:
            plan.load_start = plan.load_end = 0
            return
        covered = plan.load_from_tokens + num_external_tokens
        plan.load_end = min(plan.load_end, -(-covered // self._block_size), len(block_ids))
        if not plan.load_async:
            plan.load_accepted = True
            return
        span = slice(plan.load_start, plan.load_end)
        rid = request.request_id
        self._async_loads[rid] = BlockTransfer(rid, tuple(block_ids[span]), tuple(plan.keys[span]))
        plan.load_start = plan.load_end = 0

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's loads, saves and prefetches; a step that schedules and finishes nothing after nothing new
        (see the module docstring) answers the shared empty metadata without planning."""
        if not (output.scheduled or output.finished_req_ids or self.due or self.load_deadlines.running):
            if self.deadline.enabled:
                self.deadline.step(0)  # counts the rule's probes
            return _NOTHING[self._transfer.async_save]
        self.due = False
        loads: list[BlockTransfer] = []
        saves: list[BlockTransfer] = []
        producer = self.context.settings.is_producer
        async_save = self._transfer.async_save
        bs = self._block_size
        async_loads = tuple(self._async_loads.values())
        self._async_loads = {}
        for transfer in async_loads:
            self._plans[transfer.request_id].held = True
        for sched in output.scheduled:
            plan = self._plan(sched.request)
            rid = sched.request.request_id
            self.load_deadlines.done(rid)  # scheduled: its background load, if any, ended
            if plan.load_accepted:
                end = min(plan.load_end, len(sched.block_ids))
                if end > plan.load_start:
                    span = slice(plan.load_start, end)
                    loads.append(BlockTransfer(rid, tuple(sched.block_ids[span]), tuple(plan.keys[span])))
                if self.prefetch is not None:
                    self.prefetch.loaded(rid)  # the worker frees its staging with this load
                plan.load_accepted = False
                plan.load_start = plan.load_end = 0
            if producer:
                prompt_len = len(sched.request.prompt_token_ids)
                done = min(sched.num_computed_tokens + sched.num_scheduled_tokens, prompt_len) // bs
                save = plan.take_save(rid, sched.block_ids, sched.num_computed_tokens // bs, done)
                if save is not None:
                    saves.append(save)
                    self._recent.add(save.block_keys)
                    plan.held = plan.held or async_save
        for rid in output.finished_req_ids:
            self._plans.pop(rid, None)
            self._recompute.discard(rid)
            self.load_deadlines.done(rid)
        tokens = sum(s.num_scheduled_tokens for s in output.scheduled)
        self.deadline.step(tokens)  # the prefill rate's sample
        self.due = tokens >= MIN_STEP_TOKENS  # a prefill sample: the next step's plan closes it
        if self.lookups is not None:
            self.lookups.flush()  # the step's queued lookups, in one background round trip
        prefetches, drops = self.prefetch.take() if self.prefetch is not None else ((), ())
        cancels = self.load_deadlines.due(self.deadline)  # before this step's loads: a load gets its whole deadline
        self._recompute.update(cancels)  # asked again once vLLM takes its blocks back: it computes
        self.load_deadlines.sent(async_loads, self.deadline)
        meta = StoreTransferMetadata(tuple(loads), tuple(saves), async_loads, async_save, prefetches, drops)
        return replace(meta, load_cancels=cancels) if cancels else meta

    def shutdown(self) -> None:
        self.deadline.stop()
        if self.lookups is not None:
            self.lookups.shutdown()
        super().shutdown()

    def request_finished(self, request: KVRequest, block_ids: Sequence[int]) -> tuple[bool, dict[str, object] | None]:
        """Hold the blocks (``delay_free``) when an asynchronous transfer of this request reached the worker."""
        self.due = True  # its prefetch staging, if any, is dropped by the next plan
        self._async_loads.pop(request.request_id, None)  # planned, never sent: nothing to wait for
        self._recompute.discard(request.request_id)
        if self.lookups is not None:
            self.lookups.drop(request.request_id)  # its lookup, queued, running or answered, is of no more use
        if self.prefetch is not None:
            self.prefetch.release(request.request_id)  # its staging, if any, is dropped next step
        plan = self._plans.pop(request.request_id, None)
        return plan is not None and plan.held, None


__all__ = ["ASYNC_LOAD_MIN_BYTES", "AUTO_PREFETCH_LOOKUP_S", "StoreSchedulerConnector", "StoreTransferMetadata"]
