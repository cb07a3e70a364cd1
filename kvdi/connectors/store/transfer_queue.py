"""Background I/O for a worker half: saves bounded by bytes in flight, loads reported per request.

Jobs run on small thread pools (one for saves, one for loads, so a load never waits behind
a queue of saves). Saves run on ``threads`` threads, loads on ``load_threads``: with more than
one, several requests' loads are in flight at once, each finishing (and reported) on its own.
A job returns an :class:`Outcome`; the caller collects outcomes on its own thread
(:meth:`TransferQueue.harvest`) and applies them, so counters are only ever changed by one
thread. :meth:`TransferQueue.submit_save` blocks while the bytes of
uncollected saves would pass the bound: a medium slower than the engine slows the engine
down, it never drops a save.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields

from kvdi.connectors.base import ConnectorStats

logger = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What one background job did: counters to add, and (loads) the block ids that did not load."""

    request_id: str
    is_load: bool
    stats: ConnectorStats = field(default_factory=ConnectorStats)
    failed_blocks: tuple[int, ...] = ()


def add_stats(total: ConnectorStats, part: ConnectorStats) -> None:
    """Add every counter of ``part`` to ``total`` in place."""
    for f in fields(ConnectorStats):
        setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))


@dataclass
class _Job:
    request_id: str
    is_load: bool
    nbytes: int
    blocks: tuple[int, ...]
    future: Future[Outcome]


class TransferQueue:
    """Background jobs of one worker half, collected in submission order."""

    def __init__(self, name: str, max_inflight_bytes: int, threads: int = 1, load_threads: int | None = None) -> None:
        self.name = name
        self.max_inflight_bytes = max_inflight_bytes
        self._threads = threads
        self.load_threads = threads if load_threads is None else load_threads
        """Loads that run at once (``transfer.load_threads`` for the store connectors)."""
        self._saver: ThreadPoolExecutor | None = None
        self._loader: ThreadPoolExecutor | None = None
        self.jobs: list[_Job] = []
        """Jobs queued, running, or finished and not collected, in submission order; empty: nothing in flight (read
        it, never change it, outside: an empty list is the worker half's check for a step with nothing to collect)."""
        self.backpressure_waits = 0

    @property
    def inflight_bytes(self) -> int:
        """Bytes of saves queued or running (finished ones no longer count, collected or not)."""
        return sum(j.nbytes for j in self.jobs if not j.is_load and not j.future.done())

    def _pool(self, is_load: bool) -> ThreadPoolExecutor:
        if is_load:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(self.load_threads, thread_name_prefix=f"kvdi-{self.name}-load")
            return self._loader
        if self._saver is None:
            self._saver = ThreadPoolExecutor(self._threads, thread_name_prefix=f"kvdi-{self.name}-save")
        return self._saver

    def submit_save(self, request_id: str, nbytes: int, blocks: tuple[int, ...], job: Callable[[], Outcome]) -> None:
        """Queue a save of ``nbytes``; first wait while queued saves hold more than the bound.

        A single save larger than the bound runs alone. Outcomes of saves that finished while
        waiting stay queued for :meth:`harvest`.
        """
        while self.inflight_bytes and self.inflight_bytes + nbytes > self.max_inflight_bytes:
            running = [j.future for j in self.jobs if not j.is_load and not j.future.done()]
            self.backpressure_waits += 1
            wait(running, return_when=FIRST_COMPLETED)
        self.jobs.append(_Job(request_id, False, nbytes, blocks, self._pool(False).submit(job)))

    def submit_load(self, request_id: str, blocks: tuple[int, ...], job: Callable[[], Outcome]) -> None:
        """Queue a load; its outcome comes back through :meth:`harvest`."""
        self.jobs.append(_Job(request_id, True, 0, blocks, self._pool(True).submit(job)))

    def harvest(self, loads: bool | None = None) -> list[Outcome]:
        """Outcomes of finished jobs (saves, or loads when ``loads``; both when None, loads first), removed from the
        queue in one pass; never blocks. A job finishing meanwhile stays queued for the next harvest."""
        done = [j for j in self.jobs if (loads is None or j.is_load == loads) and j.future.done()]
        if not done:
            return []
        taken = {id(j) for j in done}
        self.jobs = [j for j in self.jobs if id(j) not in taken]
        if loads is None:
            done = [j for j in done if j.is_load] + [j for j in done if not j.is_load]
        return [self._outcome(j) for j in done]

    def _outcome(self, job: _Job) -> Outcome:
        exc = job.future.exception()
        if exc is None:
            return job.future.result()
        logger.error("kv connector %r: a background transfer raised %r; counting its blocks as failed", self.name, exc)
        out = Outcome(job.request_id, job.is_load, failed_blocks=job.blocks if job.is_load else ())
        if job.is_load:
            out.stats.load_failures += len(job.blocks)
        else:
            out.stats.save_failures += len(job.blocks)
        return out

    def pending(self, request_id: str) -> bool:
        """True while a job of the request is queued, running, or finished but not collected."""
        return any(j.request_id == request_id for j in self.jobs)

    @property
    def loads_in_flight(self) -> int:
        """Loads queued or running (finished ones, collected or not, no longer count)."""
        return sum(1 for j in self.jobs if j.is_load and not j.future.done())

    def wait_loads(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until some load has finished (collected or not); True when one has, or
        when none was in flight. Waits on a condition variable, so the GIL is free for the loader meanwhile."""
        loads = [j.future for j in self.jobs if j.is_load]
        if not loads:
            return True
        done, _ = wait(loads, timeout=timeout_s, return_when=FIRST_COMPLETED)
        return bool(done)

    def wait(self, request_ids: Collection[str] | None = None) -> None:
        """Block until every job (or every job of ``request_ids``) has finished; collects nothing."""
        futures = [j.future for j in self.jobs if request_ids is None or j.request_id in request_ids]
        wait(futures)

    def shutdown(self) -> None:
        """Finish every queued job and stop the threads."""
        for pool in (self._saver, self._loader):
            if pool is not None:
                pool.shutdown(wait=True)
        self._saver = self._loader = None


__all__ = ["Outcome", "TransferQueue", "add_stats"]
