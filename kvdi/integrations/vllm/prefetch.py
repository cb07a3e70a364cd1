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

from kvdi.connectors.base import PrefetchingScheduler, PrefetchingWorker, SchedulerConnector, WorkerConnector
from kvdi.integrations.vllm.groups import GroupSpec
from kvdi.integrations.vllm.parallel import RankSlice
from kvdi.integrations.vllm.stats import AdapterStats

logger = logging.getLogger(f"vllm.{__name__}")


class PrefetchHooks:
    """Mixed into :class:`~kvdi.integrations.vllm.connector.KvdiConnector` (which sets these attributes)."""

    half: SchedulerConnector | WorkerConnector
    groups: list[GroupSpec]
    counts: AdapterStats
    _scheduler: SchedulerConnector | None
    _worker: WorkerConnector | None
    _shape: RankSlice
    _index_mode: bool
    _prefetcher: PrefetchingScheduler | None = None  # the scheduler half, once prefetch is on
    _prefetch_source: PrefetchingWorker | None = None  # the worker half, when it can prefetch

    def _prefetch_setup(self) -> None:
        """Scheduler role: hand the store half's load policy (:mod:`kvdi.connectors.store.load_policy`) what this
        engine allows (prefetch needs one KV cache group, one rank and a store the worker reads), let it decide
        once whether hits prefetch at lookup, and log its decision and why."""
        if isinstance(self._worker, PrefetchingWorker):
            self._prefetch_source = self._worker
        if self._scheduler is None:
            return
        if not isinstance(self._scheduler, PrefetchingScheduler):
            if self.half.context.settings.transfer.async_load == "prefetch":
                logger.warning(
                    "kvdi: transfer.async_load=prefetch is not available here (the connector has no store scheduler "
                    "half); hits load as with auto"
                )
            return
        unavailable = (
            "several KV cache groups" if len(self.groups) > 1
            else "tensor or pipeline parallelism" if self._shape.sliced
            else "its blocks live in the worker's memory (a block index)" if self._index_mode
            else None
        )  # fmt: skip
        if self._scheduler.enable_prefetch(unavailable):
            self._prefetcher = self._scheduler
        policy = self._scheduler.load_policy
        (logger.warning if policy.refused else logger.info)("kvdi: %s", policy.describe())

    def _prefetch_reported(self, reports: tuple[tuple[str, int], ...]) -> None:
        """Scheduler role: the worker's finished prefetches, ``(request, leading blocks staged)``."""
        if reports and self._prefetcher is not None:
            self._prefetcher.prefetched(reports)
            self.counts.prefetch_reported += len(reports)
            self.counts.prefetch_staged_blocks += sum(n for _, n in reports)

    def _prefetch_reports(self) -> tuple[tuple[str, int], ...]:
        """Worker role: prefetches finished since the last step, for this step's worker metadata."""
        return tuple(self._prefetch_source.prefetch_reports()) if self._prefetch_source is not None else ()


__all__ = ["PrefetchHooks"]
