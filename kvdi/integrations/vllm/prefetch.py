"""Prefetch at lookup in vLLM (``transfer.async_load=prefetch``, or ``auto`` for a remote store): the adapter
relays the worker's reports.

The store halves do the work (:mod:`kvdi.connectors.store.prefetch`): a lookup that finds a hit
answers vLLM ``None`` ("ask again": the request waits, holding no KV block) while the worker
half fetches the hit into bounded host staging, then offers exactly the blocks that arrived as a
synchronous load from staging. The worker's reports reach the scheduler through vLLM's
worker-to-scheduler metadata (:class:`KvdiWorkerMetadata.prefetched`), which works with vLLM's
in-process and its multiprocess engine core alike.

Prefetch runs with one KV cache group, one worker rank (no tensor or pipeline parallelism: each
rank would stage its own slice and report on its own) and a store read by the worker itself
(not a :class:`BlockIndex` connector); otherwise hits take ``async_load=auto``'s path, as logged. The store
half's :class:`~kvdi.connectors.store.load_policy.LoadPolicy` decides, once, at start, and says why in one line
the adapter logs.
"""

from __future__ import annotations

import logging

from kvdi.connectors.base import PrefetchingScheduler, SchedulerConnector
from kvdi.connectors.store.scheduler import StoreSchedulerConnector
from kvdi.integrations.vllm.block_index import BlockIndex
from kvdi.integrations.vllm.parallel import RankSlice

logger = logging.getLogger(f"vllm.{__name__}")


def prefetch_unavailable(num_groups: int, shape: RankSlice, index_mode: bool) -> str | None:
    """Why prefetch at lookup cannot run in this engine (it needs one KV cache group, one rank and a store the
    worker reads itself), or None when it can."""
    return (
        "several KV cache groups" if num_groups > 1
        else "tensor or pipeline parallelism" if shape.sliced
        else "its blocks live in the worker's memory (a block index)" if index_mode
        else None
    )  # fmt: skip


def start_prefetch(half: SchedulerConnector, unavailable: str | None) -> PrefetchingScheduler | None:
    """Hand the scheduler half's load policy (:mod:`kvdi.connectors.store.load_policy`) what this engine allows,
    let it decide once whether hits prefetch at lookup, and log its decision and why; the half when it prefetches.
    Then :func:`start_lookups` (the measurement of the store's round trip is shared)."""
    prefetcher = _start_prefetch(half, unavailable)
    start_lookups(half)
    return prefetcher


def start_lookups(half: SchedulerConnector) -> bool:
    """Let a store scheduler half decide once, by ``scheduler.lookup`` and its load policy, whether its lookups run
    in the background (vLLM asks again after a ``None``: :mod:`kvdi.connectors.store.lookups`); log it; True if so."""
    if not isinstance(half, StoreSchedulerConnector):
        if half.context.settings.scheduler.lookup == "async":
            logger.warning("kvdi: scheduler.lookup=async is not available here (no store scheduler half); sync")
        return False
    index = isinstance(half.store, BlockIndex)  # the scheduler's own key index: in memory, not thread-safe
    on = half.enable_lookups("the store is the scheduler's in-process key index" if index else None)
    logger.info("kvdi: %s", half.load_policy.describe_lookup())
    if half.deadline.enabled:
        logger.info("kvdi: %s", half.deadline.describe())
    return on


def _start_prefetch(half: SchedulerConnector, unavailable: str | None) -> PrefetchingScheduler | None:
    if not isinstance(half, PrefetchingScheduler):
        if half.context.settings.transfer.async_load == "prefetch":
            logger.warning(
                "kvdi: transfer.async_load=prefetch is not available here (the connector has no store scheduler "
                "half); hits load as with auto"
            )
        return None
    on = half.enable_prefetch(unavailable)
    policy = half.load_policy
    (logger.warning if policy.refused else logger.info)("kvdi: %s", policy.describe())
    return half if on else None


__all__ = ["prefetch_unavailable", "start_lookups", "start_prefetch"]
