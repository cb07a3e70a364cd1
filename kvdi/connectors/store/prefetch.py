"""Prefetch at lookup: a remote or cold hit is fetched into bounded host staging before vLLM allocates blocks.

The pattern of vLLM's tiered offloading and LMCache's asynchronous lookup. With
``transfer.async_load=prefetch`` (and a host that relays the worker's reports, as the vLLM
adapter does), a lookup that finds a hit answers "ask again" (``None``) and sends the hit's keys
to the worker half (``StoreTransferMetadata.prefetches``), which fetches the framed objects into
host memory in the background (:class:`HostStaging`), holding no KV block during network time.
The worker reports each finished prefetch (how many leading objects arrived); the next lookup
then offers exactly those blocks as a synchronous load, which reads them from staging (a copy,
each frame verified as any load: a corrupt one is a counted miss and recomputed).

Both sides bound the staging by ``transfer.prefetch_max_bytes``: past it the scheduler takes the
plain path (a load from the store) and the worker refuses (reports 0 blocks: a miss). A request
that finishes or is aborted before its load frees its staging (``prefetch_drops``); a load frees
what it read and the rest of its request's staging.

A prefetch cannot wedge its request: whatever its store call does (raises, returns junk such as
an entry that is no buffer, never returns), the worker reports it. Every failure is a report of
the objects staged before it (0: a miss, counted in ``load_failures``); a fetch still running
``transfer.prefetch_timeout_s`` after it was asked for is reported as a miss and its staging
released (the thread, if the store hangs for good, ends with the store's own timeout, its
result discarded), and the scheduler side gives a prefetch that was never reported one second
more, then takes the plain path and releases its reservation.

With ``scheduler.load_deadline`` (:mod:`.deadline`) a prefetch also has a deadline from the cost model
(:meth:`PrefetchPlanner.past_deadline`): past it the scheduler half abandons it (the request computes) and
releases it, so the worker drops its staging and a fetch that returns later stages nothing; each prefetch
reported in time is handed to ``on_loaded`` (bytes, seconds) for the model's throughput.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvdi.connectors.base import BlockTransfer
from kvdi.connectors.store.framing import Buffer
from kvdi.connectors.store.keys import KEY_BYTES
from kvdi.connectors.store.protocol import BlockStore, StoreView

if TYPE_CHECKING:
    from kvdi.settings import TransferSettings

logger = logging.getLogger(__name__)

ASK_AGAIN = None
"""What a lookup answers while its prefetch runs (vLLM's "cannot tell yet": the request waits a step)."""


@dataclass
class _Planned:
    first: int  # the block the prefetched keys start at
    keys: tuple[bytes, ...]
    nbytes: int
    ready: int | None = None  # leading objects staged, once reported
    started: float = field(default_factory=time.monotonic)


PREFETCH_THREADS = 8
"""Prefetches a worker half runs at once (one request each, waiting on the network with the GIL released). A step's
arrivals prefetch together: with 2 threads the third and fourth requests of a step waited a whole round trip behind
the first two, and at 50 ms each way ran past the deadline that expects one round trip (the ``50`` row of
``bench_remote.py --rows``: 2 of 4 prefetches abandoned after 242 ms, then recomputed)."""

REPORT_GRACE_S = 1.0
"""How much longer than the worker's deadline the scheduler side waits for a prefetch's report."""


class PrefetchPlanner:
    """Scheduler side: which requests' hits are being prefetched, and the bytes reserved for them."""

    def __init__(
        self,
        max_bytes: int,
        frame_bytes: int,
        timeout_s: float = 10.0,
        on_loaded: Callable[[int, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.on_loaded = on_loaded  # (bytes staged, seconds from asked to reported) per prefetch reported in time
        self.clock = clock
        self.max_bytes = max_bytes
        self.frame_bytes = frame_bytes
        self.timeout_s = timeout_s
        self.reserved = 0
        self._planned: dict[str, _Planned] = {}
        self._send: list[BlockTransfer] = []
        self._drops: list[str] = []
        self._plain: set[str] = set()  # requests whose prefetch was overdue
        self.fallbacks = 0  # hits past the bound: loaded the plain way
        self.overdue = 0  # prefetches never reported within timeout_s + REPORT_GRACE_S: the plain path

    def ready(self, request_id: str, first: int) -> int | None:
        """For a request whose lookup starts at block ``first``: ``None`` (ask again) while its prefetch runs;
        once done, the block its staged hit ends at (a load of ``[first, end)``), or -1 for a plain lookup
        (no prefetch, or one of no use: vLLM's own hit moved past it or before it, which drops it)."""
        planned = self._planned.get(request_id)
        if planned is None:
            return -1
        if planned.ready is None:
            if self.clock() - planned.started <= self.timeout_s + REPORT_GRACE_S:
                return ASK_AGAIN
            self.overdue += 1  # the report never came (a wedged worker): never wait for it forever
            self.release(request_id)
            self._plain.add(request_id)  # and never prefetch for it again: its lookups take the plain path
            return -1
        end = planned.first + planned.ready
        if first < planned.first or first > end:
            self.release(request_id)
            return -1
        return end

    def past_deadline(self, request_id: str, deadline_s: Callable[[int], float]) -> float | None:
        """Seconds the request's unreported prefetch has run, when past ``deadline_s(blocks asked for)`` (asked now:
        the estimates move while it runs); None otherwise."""
        planned = self._planned.get(request_id)
        if planned is None or planned.ready is not None:
            return None
        elapsed = self.clock() - planned.started
        return elapsed if elapsed > deadline_s(len(planned.keys)) else None

    def start(self, request_id: str, first: int, keys: Sequence[bytes]) -> bool:
        """Plan the prefetch of a hit of ``keys`` from block ``first``; False past the bound (the plain path)."""
        nbytes = len(keys) * self.frame_bytes
        if not keys or self.reserved + nbytes > self.max_bytes or request_id in self._plain:
            self.fallbacks += 1
            return False
        self._planned[request_id] = _Planned(first, tuple(keys), nbytes, started=self.clock())
        self.reserved += nbytes
        self._send.append(BlockTransfer(request_id, tuple(range(first, first + len(keys))), tuple(keys)))  # positions
        return True

    def loaded(self, request_id: str) -> None:
        """The staged blocks were planned as a load: the worker frees them with it."""
        planned = self._planned.pop(request_id, None)
        if planned is not None:
            self.reserved -= planned.nbytes

    def release(self, request_id: str) -> None:
        """The request ended (or its prefetch is of no use): the worker drops its staging."""
        self._plain.discard(request_id)
        planned = self._planned.pop(request_id, None)
        if planned is not None:
            self.reserved -= planned.nbytes
            self._drops.append(request_id)

    def reported(self, reports: Iterable[tuple[str, int]]) -> None:
        """The worker's reports: ``(request, leading objects staged)`` per finished prefetch."""
        for request_id, count in reports:
            planned = self._planned.get(request_id)
            if planned is not None and planned.ready is None:
                planned.ready = max(0, min(int(count), len(planned.keys)))
                if planned.ready and self.on_loaded is not None:
                    self.on_loaded(planned.ready * self.frame_bytes, self.clock() - planned.started)

    def take(self) -> tuple[tuple[BlockTransfer, ...], tuple[str, ...]]:
        """This step's prefetches to start and staging to drop (each sent once)."""
        send, drops = tuple(self._send), tuple(self._drops)
        self._send, self._drops = [], []
        return send, drops

    @property
    def drops_due(self) -> bool:
        """Staging of ended requests not yet dropped: the host should step once more to tell the worker."""
        return bool(self._drops)


@dataclass
class _Staged:
    nbytes: int
    objects: dict[bytes, Buffer] = field(default_factory=dict)
    future: Future[int] | None = None
    dropped: bool = False
    started: float = field(default_factory=time.monotonic)


class HostStaging:
    """Worker side: prefetched framed objects in host memory, by request, at most ``max_bytes`` in all."""

    def __init__(
        self,
        store: BlockStore,
        max_bytes: int,
        frame_bytes: int,
        name: str,
        threads: int = PREFETCH_THREADS,
        timeout_s: float = 10.0,
    ) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.frame_bytes = frame_bytes
        self.name = name
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._staged: dict[str, _Staged] = {}
        self._reports: list[tuple[str, int]] = []
        self.refused = 0  # prefetches past the bound: reported as misses
        self.failed = 0  # prefetches the store failed: reported as misses, counted as load failures
        self.timed_out = 0  # prefetches still running after timeout_s: reported as misses, staging released
        self._failed_counted = 0

    @classmethod
    def of(cls, store: BlockStore, transfer: TransferSettings, frame_bytes: int, name: str) -> HostStaging | None:
        """The staging of a worker half under ``transfer.async_load=prefetch`` or ``auto``; None otherwise (it holds
        nothing and starts no thread until the scheduler half sends a prefetch)."""
        on = transfer.async_load in ("prefetch", "auto")  # auto: the scheduler half decides (its lookup round trip)
        if not on:
            return None
        return cls(store, transfer.prefetch_max_bytes, frame_bytes, name, timeout_s=transfer.prefetch_timeout_s)

    @property
    def held_bytes(self) -> int:
        """Bytes reserved for staged or running prefetches."""
        with self._lock:
            return self._held_locked()

    def _held_locked(self) -> int:
        return sum(s.nbytes for s in self._staged.values())

    def _running_locked(self) -> list[Future[int]]:
        return [s.future for s in self._staged.values() if s.future is not None and not s.future.done()]

    @property
    def requests(self) -> set[str]:
        with self._lock:
            return set(self._staged)

    def apply(self, prefetches: Sequence[BlockTransfer], drops: Sequence[str]) -> None:
        """Drop the staging of ``drops``, then start ``prefetches`` (a request's keys each)."""
        for request_id in drops:
            self.drop(request_id)
        for t in prefetches:
            self.start(t.request_id, t.block_keys)

    def start(self, request_id: str, keys: Sequence[bytes]) -> None:
        nbytes = len(keys) * self.frame_bytes
        with self._lock:
            if request_id in self._staged or self._held_locked() + nbytes > self.max_bytes:
                self.refused += 1
                self._reports.append((request_id, 0))
                return
            staged = self._staged[request_id] = _Staged(nbytes)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=f"kvdi-{self.name}-prefetch")
        staged.future = self._pool.submit(self._fetch, request_id, staged, tuple(keys))

    def _fetch(self, request_id: str, staged: _Staged, keys: tuple[bytes, ...]) -> int:
        """Background: the leading present objects of ``keys`` (one store call), staged; how many. Always reports
        (unless dropped or timed out meanwhile): a store that raises or answers junk is a miss from that entry on."""
        count, failure = 0, None
        try:
            objects = self.store.get_many(keys)
            if not isinstance(objects, list) or len(objects) != len(keys):
                raise TypeError(f"get_many returned {type(objects).__name__} for {len(keys)} keys")
            for key, obj in zip(keys, objects, strict=True):
                if obj is None:
                    break  # a gap ends the hit
                if not isinstance(obj, bytes | bytearray | memoryview):
                    raise TypeError(f"get_many returned an entry of type {type(obj).__name__}")
                if memoryview(obj).nbytes > self.frame_bytes:
                    break  # an odd object ends the hit; the load verifies the rest
                staged.objects[key] = obj
                count += 1
        except Exception as exc:  # the medium failed, or answered junk: a miss from here, recomputed
            failure = exc
        with self._lock:
            if failure is not None:
                self.failed += 1
            if staged.dropped:
                staged.objects.clear()
            else:
                self._reports.append((request_id, count))
        if failure is not None:
            logger.warning("kv connector %r: prefetch of %d blocks failed after %d, recomputing: %r", self.name,
                           len(keys), count, failure)  # fmt: skip
        return count

    def reports(self) -> tuple[list[tuple[str, int]], int]:
        """Prefetches finished since the last call, ``(request, leading objects staged)``, and how many of them
        the store failed (for the worker half's ``load_failures``). A prefetch running past ``timeout_s`` is
        reported here as a miss (0) and its staging released."""
        now = time.monotonic()
        with self._lock:
            for request_id, staged in list(self._staged.items()):
                if staged.future is not None and not staged.future.done() and now - staged.started > self.timeout_s:
                    del self._staged[request_id]
                    staged.dropped = True  # the fetch, if it ever returns, stages and reports nothing
                    staged.objects.clear()
                    self.timed_out += 1
                    self.failed += 1
                    self._reports.append((request_id, 0))
                    logger.warning("kv connector %r: prefetch for request %r still running after %ss: recomputing",
                                   self.name, request_id, self.timeout_s)  # fmt: skip
            out, self._reports = self._reports, []
            failed, self._failed_counted = self.failed - self._failed_counted, self.failed
        return out, failed

    def drop(self, request_id: str) -> None:
        """Free a request's staging now (a running fetch frees it when it ends)."""
        with self._lock:
            staged = self._staged.pop(request_id, None)
            if staged is not None:
                staged.dropped = True
                staged.objects.clear()

    def take(self, request_id: str) -> StagedReader | None:
        """A finished prefetch's objects, taken out of staging (freed with the returned view), as a store view
        for the request's load; None when the request has none (or its fetch still runs: the store serves)."""
        with self._lock:
            staged = self._staged.get(request_id)
            if staged is None or staged.future is None or not staged.future.done():
                return None
            del self._staged[request_id]
        return StagedReader(staged.objects, self.store)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._running_locked())

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a running prefetch ends (GIL released); True when one did or none ran."""
        with self._lock:
            running = self._running_locked()
        if not running:
            return True
        done, _ = wait(running, timeout=timeout_s, return_when=FIRST_COMPLETED)
        return bool(done)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            self._staged.clear()


class StagedReader(StoreView):
    """A :class:`BlockStore` view for one load: its staged objects first (each handed out once), then the store."""

    def __init__(self, objects: dict[bytes, Buffer], store: BlockStore) -> None:
        super().__init__(store)
        self._objects = objects

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        objects = [self._objects.pop(k, None) for k in keys]
        missing = [i for i, o in enumerate(objects) if o is None]
        if missing:
            for i, obj in zip(missing, self._store.get_many([keys[i] for i in missing]), strict=True):
                objects[i] = obj
        return objects


def lookup_round_trip(store: BlockStore, tries: int = 5) -> float | None:
    """The seconds of the fastest of ``tries`` lookups of a key no store holds: the round trip to the medium,
    with a busy machine's hiccups left out; None when the store fails them (``auto`` keeps its local rules)."""
    times = []
    key = [os.urandom(KEY_BYTES)]
    try:
        for _ in range(tries):
            start = time.perf_counter()
            store.count_prefix(key)
            times.append(time.perf_counter() - start)
    except Exception:  # a store that cannot answer now: decided by its own rules
        return None
    return min(times)


__all__ = ["ASK_AGAIN", "PREFETCH_THREADS", "HostStaging", "PrefetchPlanner", "StagedReader", "lookup_round_trip"]
