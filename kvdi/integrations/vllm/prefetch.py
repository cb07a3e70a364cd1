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
from typing import Any

from kvdi.integrations.vllm.stats import AdapterStats

logger = logging.getLogger(f"vllm.{__name__}")


class PrefetchHooks:
    """Mixed into :class:`~kvdi.integrations.vllm.connector.KvdiConnector` (which sets these attributes)."""

    half: Any
    groups: list[Any]
    counts: AdapterStats
    _scheduler: Any
    _worker: Any
    _shape: Any
    _index_mode: bool

    def _prefetch_setup(self) -> None:
        """Scheduler role: turn prefetch on in the store half when ``async_load=prefetch``, or when ``auto`` finds
        the store remote (it says so, or its lookup round trip measures 1 ms or more), and it can run here."""
        mode = self.half.context.settings.transfer.async_load
        if self._scheduler is None or mode not in ("prefetch", "auto"):
            return
        enable = getattr(self._scheduler, "enable_prefetch", None)
        why = (
            "the connector has no store scheduler half" if not callable(enable)
            else "several KV cache groups" if len(self.groups) > 1
            else "tensor or pipeline parallelism" if self._shape.sliced
            else "its blocks live in the worker's memory (a block index)" if self._index_mode
            else None
        )  # fmt: skip
        if why is None and callable(enable) and enable():
            rtt = getattr(self._scheduler, "lookup_s", None)
            measured = f"; store lookup {rtt * 1e3:.2f} ms" if rtt is not None else ""
            logger.info(
                "kvdi: prefetch at lookup on (async_load=%s%s; host staging up to %d B)",
                mode, measured, self._scheduler.prefetch.max_bytes,
            )  # fmt: skip
        elif mode == "prefetch":
            logger.warning("kvdi: transfer.async_load=prefetch is not available here (%s); hits load as with auto", why)
        elif why is None:
            rtt = getattr(self._scheduler, "lookup_s", None)
            logger.info(
                "kvdi: async_load=auto: a local store (lookup %s): no prefetch", f"{rtt * 1e3:.2f} ms" if rtt else "?"
            )

    def _prefetch_reported(self, reports: tuple[tuple[str, int], ...]) -> None:
        """Scheduler role: the worker's finished prefetches, ``(request, leading blocks staged)``."""
        if reports and self._scheduler is not None and getattr(self._scheduler, "prefetch", None) is not None:
            self._scheduler.prefetched(reports)
            self.counts.prefetch_reported += len(reports)
            self.counts.prefetch_staged_blocks += sum(n for _, n in reports)

    def _prefetch_reports(self) -> tuple[tuple[str, int], ...]:
        """Worker role: prefetches finished since the last step, for this step's worker metadata."""
        take = getattr(self._worker, "prefetch_reports", None)
        return tuple(take()) if callable(take) else ()


__all__ = ["PrefetchHooks"]
