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
(not a :class:`BlockIndex` connector); otherwise hits take ``async_load=auto``'s path, as logged. Under ``auto``
the store half decides at start: a store that says it is remote, or whose lookup round trip measures 1 ms or
more, prefetches (:data:`kvdi.connectors.store.scheduler.AUTO_PREFETCH_LOOKUP_S`); a local one does not.
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
        """Scheduler role: turn prefetch on in the store half when ``async_load=prefetch``, or when ``auto`` finds
        the store remote (it says so, or its lookup round trip measures 1 ms or more), and it can run here."""
        if isinstance(self._worker, PrefetchingWorker):
            self._prefetch_source = self._worker
        mode = self.half.context.settings.transfer.async_load
        if self._scheduler is None or mode not in ("prefetch", "auto"):
            return
        sched = self._scheduler if isinstance(self._scheduler, PrefetchingScheduler) else None
        why = (
            "the connector has no store scheduler half" if sched is None
            else "several KV cache groups" if len(self.groups) > 1
            else "tensor or pipeline parallelism" if self._shape.sliced
            else "its blocks live in the worker's memory (a block index)" if self._index_mode
            else None
        )  # fmt: skip
        if why is None and sched is not None and sched.enable_prefetch() and sched.prefetch is not None:
            self._prefetcher = sched
            rtt = sched.lookup_s
            measured = f"; store lookup {rtt * 1e3:.2f} ms" if rtt is not None else ""
            logger.info(
                "kvdi: prefetch at lookup on (async_load=%s%s; host staging up to %d B)",
                mode, measured, sched.prefetch.max_bytes,
            )  # fmt: skip
        elif mode == "prefetch":
            logger.warning("kvdi: transfer.async_load=prefetch is not available here (%s); hits load as with auto", why)
        elif why is None and sched is not None:
            rtt = sched.lookup_s
            logger.info(
                "kvdi: async_load=auto: a local store (lookup %s): no prefetch", f"{rtt * 1e3:.2f} ms" if rtt else "?"
            )

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
