"""The load deadline for background loads already writing into KV blocks (``transfer.async_load``, :mod:`.deadline`).

A background load holds its request's KV blocks while it runs (vLLM parks the request until the worker reports it
finished receiving). With ``scheduler.load_deadline`` on, one still running past its deadline is abandoned safely:

- the scheduler half (:class:`LoadDeadlines`) notes each background load it sends, and at each step's plan sends a
  cancel (``StoreTransferMetadata.load_cancels``) for one past :meth:`~.deadline.DeadlineRule.deadline_s` of its
  tokens and bytes, counted in ``deadline_recomputes`` (the rule's :meth:`~.deadline.DeadlineRule.overran`); a load
  that ends first (its request scheduled, or finished) is forgotten;
- the worker half (:class:`LoadCancels`) reads such a load through :class:`HostReads` (the store answers into host
  buffers, never into a block) and places each chunk into its blocks under the load's :class:`LoadGuard` lock. A
  cancel takes that lock (it waits at most for the chunk being placed, never for the store) and marks the load
  cancelled: no chunk is placed after it. The worker then reports every block of the load failed and the request
  finished receiving at once (vLLM recomputes it), and drops the job's own report when it ends. The job ends when
  its store call returns (the bytes it read are dropped with their buffers); its request's blocks stay held
  (``delay_free``) until then, so no byte can land in a block vLLM has given back.

On a device cache a chunk is verified into the load's host staging and its copies into the blocks are queued on a
side stream, both under the load's lock, with an event after them (:attr:`LoadGuard.after`). A cancel (on the engine
thread) makes the engine's stream wait for that event: the copies queued before the cancel end before anything the
engine computes after it (the recompute), and none is queued after it. The host never waits for them.

A load that finished just as its cancel reached the worker loads whole and is counted. A request preempted after its
cancel does not wait for its stuck store call (:meth:`LoadCancels.preempted_jobs`): nothing of the load can land in
its blocks any more. Its saves are still waited for (they read its blocks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvdi.connectors.base import BlockTransfer, ConnectorStats
from kvdi.connectors.store.deadline import DeadlineRule
from kvdi.connectors.store.protocol import StoreView

if TYPE_CHECKING:
    from kvdi.connectors.store.blockio import CacheIO
    from kvdi.connectors.streams import StreamOrder


class LoadDeadlines:
    """Scheduler side: background loads sent and not yet ended, by request (sent at, tokens, bytes)."""

    def __init__(self, block_size: int, block_bytes: int) -> None:
        self.block_size, self.block_bytes = block_size, block_bytes
        self.running: dict[str, tuple[float, int, int]] = {}  # a plain dict: a quiet step's check is no call

    def sent(self, loads: Iterable[BlockTransfer], rule: DeadlineRule) -> None:
        """This step's background loads leave now (on ``rule``'s clock); nothing is noted with the rule off."""
        if not rule.enabled:
            return
        now = rule.clock()
        for t in loads:
            self.running[t.request_id] = (now, len(t.block_ids) * self.block_size, len(t.block_ids) * self.block_bytes)

    def done(self, request_id: str) -> None:
        """The request's load ended (it was scheduled, or it finished): no cancel for it."""
        self.running.pop(request_id, None)

    def due(self, rule: DeadlineRule) -> tuple[str, ...]:
        """Loads past their deadline now, each forgotten and counted (``rule.overran``): this step's cancels."""
        if not rule.enabled or not self.running:
            return ()
        now, out = rule.clock(), []
        for request_id, (at, tokens, nbytes) in list(self.running.items()):
            if now - at > rule.deadline_s(tokens, nbytes):
                del self.running[request_id]
                rule.overran("background load", tokens, now - at)
                out.append(request_id)
        return tuple(out)


@dataclass
class LoadGuard:
    """One background load's lock: held while a chunk is placed into its blocks; ``cancelled`` once a cancel took it.
    On a device cache (``order`` set), ``after`` is the event after the copies into its blocks queued so far."""

    block_ids: tuple[int, ...]
    order: StreamOrder | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    after: Any = None


class QueuedJob(Protocol):
    """A worker's background job as :meth:`LoadCancels.preempted_jobs` reads it (the transfer queue's)."""

    request_id: str
    is_load: bool
    future: Future[Any]


class HostReads(StoreView):
    """A store view for a cancellable load: ``get_many`` only, so every object lands in a host buffer first (no
    ``get_into_many``, ``visit_many`` or ``place_many``: those write into the blocks inside the store call)."""


class LoadCancels:
    """Worker side: the guards of cancellable background loads, and the loads cancelled whose job has not ended."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # scheduler.load_deadline: loads are read through host buffers and may be cancelled
        self._lock = threading.Lock()
        self._guards: dict[str, LoadGuard] = {}
        self._cancelled: set[str] = set()  # reported at the cancel: the job's own outcome is dropped
        self.cancelled = 0  # loads cancelled (a gauge for tests and logs)

    def open(self, transfer: BlockTransfer, order: StreamOrder | None = None) -> LoadGuard | None:
        """A guard for a background load about to be queued (None with the rule off); ``order``: a device cache's."""
        if not self.enabled:
            return None
        guard = LoadGuard(tuple(transfer.block_ids), order)
        with self._lock:
            self._guards[transfer.request_id] = guard
        return guard

    def close(self, request_id: str, guard: LoadGuard | None) -> None:
        """The load's job ended (on its thread)."""
        with self._lock:
            if guard is not None and self._guards.get(request_id) is guard:
                del self._guards[request_id]

    def cancel(self, request_id: str) -> tuple[int, ...] | None:
        """Cancel the request's running load: the blocks to report failed (all of the load's), once no chunk is being
        placed and none will be; None when it has none running (ended, or never cancellable)."""
        with self._lock:
            guard = self._guards.pop(request_id, None)
        if guard is None:
            return None
        with guard.lock:  # waits for a chunk being placed (memory copies), never for the store
            guard.cancelled = True
            after = guard.after
        if after is not None and guard.order is not None:  # the engine's stream runs after the queued copies
            guard.order.cuda.current_stream(guard.order.device).wait_event(after)
        with self._lock:
            self._cancelled.add(request_id)
        self.cancelled += 1
        return guard.block_ids

    def cancel_all(self, request_ids: Iterable[str], report: Callable[[Sequence[int]], None]) -> list[str]:
        """Cancel each request's running load (:meth:`cancel`), ``report`` its blocks failed; the requests cancelled
        (to report finished receiving now)."""
        out = []
        for request_id in request_ids:
            blocks = self.cancel(request_id)
            if blocks is not None:
                report(blocks)
                out.append(request_id)
        return out

    def preempted_jobs(self, jobs: Iterable[QueuedJob], request_ids: Collection[str] | None) -> list[Future[Any]]:
        """The jobs of preempted ``request_ids`` (None: every request) to wait for before their blocks are reused:
        all but the loads cancelled (a stuck store call places nothing after its cancel)."""
        with self._lock:
            cancelled = set(self._cancelled)
        return [
            j.future
            for j in jobs
            if (request_ids is None or j.request_id in request_ids) and not (j.is_load and j.request_id in cancelled)
        ]

    def taken(self, request_id: str) -> bool:
        """True (once) when the request's load was cancelled and reported: its job's outcome is dropped."""
        with self._lock:
            if request_id in self._cancelled:
                self._cancelled.discard(request_id)
                return True
            return False


def placed(guard: LoadGuard | None, place: Callable[[], int], io: CacheIO | None = None) -> int:
    """``place()`` (a chunk verified into its blocks: how many) under the load's guard; 0 once it is cancelled. On a
    device cache (``io`` staged) the chunk's copies into the blocks are queued under the guard too, and marked."""
    if guard is None:
        return place()
    with guard.lock:
        if guard.cancelled:
            return 0
        good = place()
        if io is not None and not io.direct and io.order is not None:
            io.submit()  # queued on the job's side stream
            guard.after = io.order.mark()
        return good


def failed_chunk(stats: ConnectorStats) -> int:
    """A cancellable load's chunk whose store call failed: a load failure, none of its blocks placed (no store call
    is made under the load's lock, so it is not read again one by one)."""
    stats.load_failures += 1
    return 0


__all__ = ["HostReads", "LoadCancels", "LoadDeadlines", "LoadGuard", "QueuedJob", "failed_chunk", "placed"]
