"""What kvdi still holds or waits for, as vLLM 0.32's scheduler and workers can ask it (vLLM-free).

- :class:`HeldSaves` (scheduler role): requests kvdi holds blocks of (``delay_free``) until
  their queued saves are written. vLLM asks ``has_pending_block_frees`` before preempting a
  running request to make room: while kvdi holds blocks, vLLM waits a step for them instead;
  ``has_pending_push_work`` keeps the engine stepping until they come back.
- ``requires_kv_delivery``: False for the store connectors, whose saves are a best-effort
  cache (a preempted request's save is a future miss, not a delivery to wait for); True for
  anything else (p2p hands KV to a peer).
- :func:`wait_for_loads` (worker role): on a step that schedules nothing, wait a bounded time
  (``transfer.idle_load_wait_ms``) for an asynchronous load to finish before answering, so
  vLLM's empty steps do not spin against the loader thread for the GIL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvdi.connectors.base import LoadWaiter, WorkerConnector
from kvdi.integrations.vllm.async_loads import WorkerLoads
from kvdi.integrations.vllm.hybrid import HybridWorker


class HeldSaves:
    """Scheduler role: requests whose blocks kvdi holds (``delay_free=True``) until vLLM hears they were sent."""

    def __init__(self, best_effort: bool) -> None:
        self.best_effort = best_effort
        self.held: set[str] = set()

    def finished(self, request_id: str, delay_free: bool) -> bool:
        """Note the ``delay_free`` answered for a finished request; returns it."""
        if delay_free:
            self.held.add(request_id)
        return delay_free

    def sent(self, request_ids: Iterable[str] | None) -> None:
        """vLLM's aggregated ``finished_sending``: those requests' blocks are vLLM's again."""
        self.held.difference_update(request_ids or ())

    def pending_block_frees(self) -> bool:
        """vLLM's ``has_pending_block_frees``: True while a store connector holds blocks of finished requests for
        queued saves (they come back on their own): vLLM waits for them instead of preempting. Never for p2p,
        whose peer may never pull."""
        return self.best_effort and bool(self.held)

    def pending_push_work(self, prefetch_drops_due: bool = False) -> bool:
        """vLLM's ``has_pending_push_work``: True while held saves are still to be reported, so the engine steps
        until their blocks come back, or while prefetch staging of ended requests is still to be dropped (the
        next step tells the worker)."""
        return bool(self.held) or prefetch_drops_due

    @property
    def requires_kv_delivery(self) -> bool:
        """False for the store connectors (a best-effort cache), True otherwise (p2p delivers to a peer)."""
        return not self.best_effort


def load_waiters(worker: WorkerConnector) -> list[Callable[[float], bool]]:
    """The ``wait_for_loads`` of ``worker`` (of each KV cache group's half, for a hybrid worker) that have one;
    found once per worker (a protocol check walks the protocol's members: too slow for every step)."""
    halves = worker.halves if isinstance(worker, HybridWorker) else (worker,)
    return [h.wait_for_loads for h in halves if isinstance(h, LoadWaiter)]


def wait_for_loads(worker: WorkerConnector, loads: WorkerLoads) -> None:
    """:func:`wait_on` the :func:`load_waiters` of ``worker``."""
    wait_on(load_waiters(worker), loads)


def wait_on(waits: list[Callable[[float], bool]], loads: WorkerLoads) -> None:
    """On an idle step (``loads.idle``), block up to ``loads.idle_wait_s`` until an asynchronous load behind
    ``waits`` finishes; at once when none is in flight or the wait is off. The wait is on a condition variable:
    the loader thread has the GIL."""
    if not loads.idle or loads.idle_wait_s <= 0 or not waits:
        return
    start = time.monotonic()
    deadline = start + loads.idle_wait_s
    for wait in waits:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        wait(left)
    waited = time.monotonic() - start
    if waited > 1e-4:  # blocked on a load, not just looked
        loads.counts.idle_load_waits += 1
        loads.counts.idle_load_wait_seconds += waited


__all__ = ["HeldSaves", "load_waiters", "wait_for_loads", "wait_on"]
