"""The store worker half's side of prefetch at lookup, a collaborator it owns (see :mod:`.prefetch`).

:class:`WorkerPrefetch` holds the worker's :class:`~.prefetch.HostStaging` (None unless
``transfer.async_load`` can prefetch) and answers the three questions the worker half asks
of it: which prefetches finished (for the scheduler half), where a request's load reads (its
staging first, then the store) and, on an idle step, whether to wait for a prefetch.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvdi.connectors.base import BlockTransfer, ConnectorStats
from kvdi.connectors.store.prefetch import HostStaging
from kvdi.connectors.store.protocol import BlockStore, StoreCapabilities

STAGED = StoreCapabilities(read_into=False, prefers_async_load=False, num_slots=None, check=None)
"""What host staging offers a load that reads from it: plain ``get_many``."""


class WorkerPrefetch:
    """Host staging of one store worker half and the reads, reports and waits over it."""

    def __init__(
        self, store: BlockStore, capabilities: StoreCapabilities, staging: HostStaging | None, stats: ConnectorStats
    ) -> None:
        self.store = store
        self.capabilities = capabilities
        self.staging = staging
        self.stats = stats  # the worker half's counters: a prefetch the store failed is a load failure

    def apply(self, prefetches: Sequence[BlockTransfer], drops: Sequence[str]) -> None:
        """This step's prefetches to start and requests whose staging is of no more use."""
        if self.staging is not None:
            self.staging.apply(prefetches, drops)

    def reports(self) -> list[tuple[str, int]]:
        """Prefetches finished since the last call, ``(request, leading blocks staged)``, for the scheduler half;
        those the store failed are counted in ``load_failures`` (a miss, recomputed)."""
        if self.staging is None:
            return []
        reports, failed = self.staging.reports()
        self.stats.load_failures += failed
        return reports

    def source(self, request_id: str) -> tuple[BlockStore, StoreCapabilities]:
        """Where a request's load reads: its prefetched host staging (taken whole, then the store), else the store."""
        staged = self.staging.take(request_id) if self.staging is not None else None
        return (staged, STAGED) if staged is not None else (self.store, self.capabilities)

    def wait(self, timeout_s: float, loads_in_flight: int) -> bool | None:
        """On an idle step with prefetches but no loads in flight: wait up to ``timeout_s`` for one (GIL released),
        True once one ended; None when that is not the case (the caller waits for its loads)."""
        if self.staging is None or loads_in_flight or not self.staging.in_flight:
            return None
        return self.staging.wait(timeout_s)

    @property
    def staged_bytes(self) -> int | None:
        """Bytes held in host staging; None without staging."""
        return self.staging.held_bytes if self.staging is not None else None

    def shutdown(self) -> None:
        if self.staging is not None:
            self.staging.shutdown()


__all__ = ["STAGED", "WorkerPrefetch"]
