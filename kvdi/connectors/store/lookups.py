"""Lookups off the scheduler's path: a store's existence checks run in the background, batched per step.

With ``scheduler.lookup=async`` (or ``auto`` for a remote store, :mod:`.load_policy`) and a host that asks again
(vLLM: a lookup answered ``None`` leaves the request waiting, asked again next step), the store
scheduler half never calls the store inside the scheduler's step. :meth:`AsyncLookups.answer`
returns a fresh answer when there is one, else queues the lookup and returns ``None`` ("ask
again"); :meth:`AsyncLookups.flush` (the half's ``build_connector_meta``, the end of the step)
hands the step's queued lookups to a background thread in one batch. A store with
``count_prefix_many`` (:class:`BatchLookupStore`: Redis, one pipeline of ``STRLEN``s) answers a
batch in one round trip; any other store answers one request per call, ``threads`` calls at once.

Bounds: at most ``threads`` background threads; at most ``max_entries`` requests queued, running
or answered (past it, answered entries are forgotten oldest first, and a new lookup waits for
room: "ask again"); a batch holds at most :data:`MAX_BATCH` requests. An answer serves its
request for ``ttl_s`` (then the store is asked again); a lookup unanswered ``timeout_s`` after
it was queued is a miss (the request computes; its result, if it ever comes, is dropped), as is
one the store fails (raises, or answers junk). :meth:`drop` forgets a finished or aborted
request's lookup at once. The answer's failure is counted by the caller, on its own thread.

With ``scheduler.load_deadline`` (:mod:`.deadline`), each batch's round trip is handed to ``on_round_trip``, and
:meth:`AsyncLookups.answer` takes a ``deadline_s``: a lookup unanswered past it is a miss at once (``overran``
says how long it ran), never waited for until ``timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvdi.connectors.store.protocol import BatchLookupStore, BlockStore

logger = logging.getLogger(__name__)

MAX_BATCH = 256
"""The most requests one background round trip looks up."""

MAX_LOOKUP_ENTRIES = 4096
"""The most requests whose lookups are queued, running or answered at once (the memory bound)."""

LOOKUP_TTL_S = 2.0
"""How long an answer serves its request (a request preempted and resumed within it asks no store)."""


def signature(first: int, keys: Sequence[bytes]) -> tuple[int, int, bytes]:
    """What a lookup asks, in a few bytes: from block ``first``, ``len(keys)`` keys ending with the last one."""
    return first, len(keys), keys[-1] if keys else b""


@dataclass
class Lookup:
    """One request's lookup: the keys asked about, from block ``first``, and the answer once it came."""

    first: int
    keys: tuple[bytes, ...]  # emptied once answered (the signature stays)
    sig: tuple[int, int, bytes]  # (first, how many keys, the last key): keys chain, so the last names the prefix
    queued: float = field(default_factory=time.monotonic)
    answer: int | None = None  # leading keys held, once answered
    answered: float = 0.0
    failure: str | None = None  # why the answer is a miss (the store failed, or the lookup timed out)
    counted: bool = False  # the failure was handed to the caller (counted once)
    overran: float | None = None  # seconds it ran before its deadline abandoned it (a miss, not a failure)


@dataclass
class LookupCounters:
    """What the background lookups did (read by tests, benchmarks and the describe line)."""

    queued: int = 0  # lookups queued ("ask again" answered)
    batches: int = 0  # background store calls
    answered: int = 0  # lookups answered by the store
    failed: int = 0  # lookups the store failed: misses
    timed_out: int = 0  # lookups unanswered after timeout_s: misses
    dropped: int = 0  # lookups of requests that ended first
    full: int = 0  # asks refused for room (max_entries running or queued): asked again
    expired: int = 0  # answers older than ttl_s, looked up again
    overran: int = 0  # lookups unanswered past their deadline (scheduler.load_deadline): misses at once


class AsyncLookups:
    """Scheduler side: background, batched store lookups by request, bounded in threads, entries and time."""

    def __init__(
        self,
        store: BlockStore,
        name: str,
        *,
        threads: int = 2,
        timeout_s: float = 2.0,
        ttl_s: float = LOOKUP_TTL_S,
        max_entries: int = MAX_LOOKUP_ENTRIES,
        on_round_trip: Callable[[float], None] | None = None,
    ) -> None:
        self.store = store
        self.name = name
        self.threads = max(1, threads)
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.max_entries = max(1, max_entries)
        self.batched = isinstance(store, BatchLookupStore)
        self.on_round_trip = on_round_trip  # each answered batch's seconds (the deadline's cost model)
        self.counters = LookupCounters()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._entries: OrderedDict[str, Lookup] = OrderedDict()  # by request, oldest first
        self._queue: OrderedDict[str, Lookup] = OrderedDict()  # queued, not yet taken by a thread
        self._running = 0  # background threads at work
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def pending(self) -> int:
        """Lookups queued or running (not yet answered)."""
        with self._lock:
            return sum(e.answer is None for e in self._entries.values())

    def asked(self, request_id: str, first: int, keys: Sequence[bytes]) -> bool:
        """True when the request's lookup of ``keys`` (from block ``first``) is queued, running or answered: the load
        deadline judged it once, when it was made, and does not judge it again while vLLM asks again."""
        with self._lock:
            entry = self._entries.get(request_id)
            return entry is not None and entry.sig == signature(first, keys)

    def answer(
        self, request_id: str, first: int, keys: Sequence[bytes], deadline_s: float = float("inf")
    ) -> Lookup | None:
        """The answered lookup of ``keys`` (from block ``first``) for the request, fresh; else None ("ask again")
        after queuing one (or while the queued one runs). A lookup past ``timeout_s`` answers as a miss, and so
        does one past ``deadline_s`` (its ``overran`` set: the caller counts a deadline recompute)."""
        now = time.monotonic()
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None and entry.sig != signature(first, keys):
                self._forget(request_id)  # vLLM's own hit moved, or the keys changed: a new question
                entry = None
            if entry is not None and entry.answer is not None and now - entry.answered > self.ttl_s:
                self.counters.expired += 1
                self._forget(request_id)
                entry = None
            if entry is None:
                self._queue_locked(request_id, first, keys, now)
                return None
            if entry.answer is None and now - entry.queued > self.timeout_s:
                self._queue.pop(request_id, None)
                entry.answer, entry.answered, entry.failure = 0, now, f"no answer within {self.timeout_s}s"
                entry.keys = ()
                self.counters.timed_out += 1
            elif entry.answer is None and now - entry.queued > deadline_s:
                self._queue.pop(request_id, None)
                entry.answer, entry.answered, entry.overran, entry.keys = 0, now, now - entry.queued, ()
                self.counters.overran += 1
            if entry.answer is None:
                return None
            self._entries.move_to_end(request_id)
            return entry

    def _queue_locked(self, request_id: str, first: int, keys: Sequence[bytes], now: float) -> None:
        """Queue a lookup for the request, making room by forgetting answered entries (none: counted, not queued)."""
        if len(self._entries) >= self.max_entries:
            for rid in [r for r, e in self._entries.items() if e.answer is not None]:
                self._forget(rid)  # answered entries make room, oldest first
                if len(self._entries) < self.max_entries:
                    break
        if len(self._entries) >= self.max_entries:
            self.counters.full += 1
            return
        entry = Lookup(first, tuple(keys), signature(first, keys), now)
        self._entries[request_id] = self._queue[request_id] = entry
        self.counters.queued += 1

    def _forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)
        self._queue.pop(request_id, None)

    def drop(self, request_id: str) -> None:
        """The request ended: forget its lookup (a running one's result is dropped when it comes)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None:
                if entry.answer is None:
                    self.counters.dropped += 1
                self._forget(request_id)

    def flush(self) -> None:
        """Start the queued lookups in the background (one batch per thread, at most ``threads`` threads)."""
        with self._lock:
            if not self._queue or self._running >= self.threads:
                return  # the running threads take the queue when they finish their batch
            self._running += 1
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"kvdi-{self.name}-lookup")
        self._pool.submit(self._run)

    def _take_locked(self) -> list[tuple[str, Lookup]]:
        size = MAX_BATCH if self.batched else 1
        batch: list[tuple[str, Lookup]] = []
        while self._queue and len(batch) < size:
            batch.append(self._queue.popitem(last=False))
        return batch

    def _run(self) -> None:
        """Background: answer batches from the queue until it is empty."""
        while True:
            with self._lock:
                batch = self._take_locked()
                if not batch:
                    self._running -= 1
                    return
                start_more = bool(self._queue) and not self.batched and self._running < self.threads
                if start_more:
                    self._running += 1
            if start_more and self._pool is not None:
                self._pool.submit(self._run)
            start = time.perf_counter()
            counts, failure = self._ask([e.keys for _, e in batch])
            if failure is None and self.on_round_trip is not None:
                self.on_round_trip(time.perf_counter() - start)
            now = time.monotonic()
            with self._done:
                self.counters.batches += 1
                for (rid, entry), count in zip(batch, counts, strict=True):
                    if self._entries.get(rid) is not entry or entry.answer is not None:
                        continue  # dropped, asked anew or timed out meanwhile
                    entry.answer, entry.answered, entry.failure, entry.keys = count, now, failure, ()
                    self.counters.answered += failure is None
                    self.counters.failed += failure is not None
                self._done.notify_all()

    def _ask(self, key_lists: list[tuple[bytes, ...]]) -> tuple[list[int], str | None]:
        """Leading keys held per list, in one store call when the store batches; all misses and why on a failure."""
        try:
            if isinstance(self.store, BatchLookupStore):
                counts = self.store.count_prefix_many(key_lists)
                if not isinstance(counts, list) or len(counts) != len(key_lists):
                    raise TypeError(f"count_prefix_many returned {type(counts).__name__} for {len(key_lists)} lists")
            else:
                counts = [self.store.count_prefix(keys) for keys in key_lists]
            for count in counts:
                if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                    raise TypeError(f"the store answered {count!r} for a count of keys")
            return [min(c, len(k)) for c, k in zip(counts, key_lists, strict=True)], None
        except Exception as exc:  # anything a store raises, or junk it answers: misses, counted by the caller
            logger.debug("kv connector %r: background lookup of %d requests failed", self.name, len(key_lists),
                         exc_info=True)  # fmt: skip
            return [0] * len(key_lists), repr(exc)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` (lock released) until a pending lookup is answered; True when none is pending
        or one was answered (an idle step waits here instead of spinning)."""
        deadline = time.monotonic() + timeout_s
        with self._done:
            before = self.counters.answered + self.counters.failed
            while any(e.answer is None for e in self._entries.values()):
                left = deadline - time.monotonic()
                if left <= 0 or self.counters.answered + self.counters.failed != before:
                    break
                self._done.wait(left)
            return self.counters.answered + self.counters.failed != before or not any(
                e.answer is None for e in self._entries.values()
            )

    def shutdown(self) -> None:
        """Forget every lookup and stop the threads (a store call under way ends with the store's timeout)."""
        with self._lock:
            self._entries.clear()
            self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


__all__ = ["LOOKUP_TTL_S", "MAX_BATCH", "MAX_LOOKUP_ENTRIES", "AsyncLookups", "BatchLookupStore", "Lookup"]
