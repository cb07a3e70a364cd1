"""The worker half of the store connectors: moves blocks between the paged cache and framed objects.

Every object it loads is verified; anything odd (a bad frame, a vanished object, any exception a store
call raises) is a counted miss, never an exception: the blocks before it stay loaded, the rest are
reported through ``get_block_ids_with_load_errors``.

Asynchronous transfers (``transfer.async_save``, ``transfer.async_load``: :mod:`.scheduler`) run on a
:class:`TransferQueue`. The invariant: no block's bytes are read or written after the engine may have reused the
block. A request with asynchronous transfers keeps its blocks (``delay_free``) until this half reports it finished
sending in :meth:`get_finished`, after its last job; :meth:`handle_preemptions` flushes the jobs of requests whose
blocks the engine takes back at once. A device cache's blocks move through pinned staging a chunk at a time
(:class:`~.blockio.CacheIO`); background jobs, asynchronous saves included, copy on a side stream after an event
recorded on the engine's stream when they were handed over (:mod:`kvdi.connectors.streams`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import TYPE_CHECKING

from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorContext,
    ConnectorStats,
    KVConnectorMetadata,
    WorkerConnector,
)
from kvdi.connectors.logging_once import log_once
from kvdi.connectors.store.codec import read_capabilities
from kvdi.connectors.store.deadline_loads import HostReads, LoadCancels, LoadGuard, failed_chunk, placed
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.integrity import frame_key
from kvdi.connectors.store.prefetch import HostStaging
from kvdi.connectors.store.protocol import require_store
from kvdi.connectors.store.reads import Readahead, ReadChunk, place_frame, read_chunk, verify_chunk
from kvdi.connectors.store.scheduler import StoreTransferMetadata
from kvdi.connectors.store.transfer_queue import Outcome, TransferQueue, add_stats
from kvdi.connectors.store.worker_prefetch import STAGED, WorkerPrefetch
from kvdi.connectors.store.worker_reads import load_one_by_one
from kvdi.connectors.store.writes import BlockWriter, save_batch_blocks

if TYPE_CHECKING:
    import torch

    from kvdi.connectors.store.blockio import CacheIO, CacheIOs

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # payload bytes per store call from a CPU cache (at least one block)
DEVICE_CHUNK_BYTES = 32 << 20  # payload bytes per staged chunk of a device cache (tens of MiB: few, large copies)
READAHEAD_BYTES = 64 << 20  # how far ahead of the chunk being read a store with prefetch() is asked to read
_IO_THREAD = {"on": True, "off": False, "auto": None}


class StoreWorkerConnector(WorkerConnector):
    """Copies blocks between the paged cache and framed objects; a bad object is a miss, never an exception.
    With ``transfer.io_thread`` on (a CPU cache), an I/O thread overlaps store calls with checksums."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.store = require_store(context)
        self.capabilities = read_capabilities(self.store)  # protocol checks are slow: once, here
        layout = context.layout
        transfer = context.settings.transfer
        self.io_thread: bool | None = _IO_THREAD[transfer.io_thread]  # overlap store calls (None: with 4+ CPUs)
        self._fingerprint = layout.fingerprint()
        self._key = frame_key(context.settings)  # None unless KVDI_INTEGRITY_KEY(_FILE) is set
        self._block_bytes = layout.block_bytes
        self._frame_bytes = HEADER_SIZE + layout.block_bytes
        self._chunk = max(1, CHUNK_BYTES // layout.block_bytes)
        self._save_batch = save_batch_blocks(self.store)  # a remote store's batch, 0 for others (:mod:`.writes`)
        self._device_chunk = max(
            1, min(DEVICE_CHUNK_BYTES, context.settings.allocator.max_staging_bytes) // layout.block_bytes
        )
        self._readahead = max(self._chunk, READAHEAD_BYTES // layout.block_bytes)  # blocks
        self._ios: CacheIOs | None = None  # this registration's cache access and its jobs' staging
        self._executor: ThreadPoolExecutor | None = None
        self._fetcher: ThreadPoolExecutor | None = None
        self._cpus: int | None = None
        self._queue = TransferQueue(self.name, transfer.max_inflight_bytes, load_threads=transfer.load_threads)
        self._writer = BlockWriter(self.store, self._fingerprint, self._key, layout.block_bytes, self._log_once)
        self.staging = HostStaging.of(self.store, transfer, self._frame_bytes, self.name)  # :mod:`.prefetch`
        self.prefetching = WorkerPrefetch(self.store, self.capabilities, self.staging, self.stats)
        self.cancels = LoadCancels(context.settings.scheduler.load_deadline)  # :mod:`.deadline_loads`
        self._async_save = transfer.async_save
        self._held: set[str] = set()  # requests with asynchronous transfers: reported when finished and done
        self._finishing: set[str] = set()
        self._received: set[str] = set()
        self._logged: set[str] = set()
        self._block_event: Callable[[bool, bytes], None] | None = None  # :meth:`watch_blocks` (KV cache events)
        self.prefetch_reports_due = False  # prefetches sent or staged since the last report (the host asks then)
        self.gauge_epoch = 0  # bumped when gauges may move: work bound, in flight, collected (vllm.fleet.store_metrics)

    def watch_blocks(self, event: Callable[[bool, bytes], None]) -> None:  # :class:`..base.BlockEventSource`
        self._block_event = self._writer.block_event = event

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from kvdi.connectors.store.blockio import CacheIOs

        layout = self.context.layout
        names = [n for n in layout.layer_names if n in kv_caches]
        tensors = [kv_caches[n] for n in names] if len(names) == len(kv_caches) else list(kv_caches.values())
        # A new registration replaces the old one whole: jobs still running give their staging back to the old one.
        args = (tensors, layout.layer_block_bytes, self._chunk, self.context.staging, f"{self.name}/store")
        self._ios = CacheIOs(*args, device_chunk=self._device_chunk, sink=self.store, layout=layout)

    @property
    def inflight_bytes(self) -> int:  # queued asynchronous saves: a gauge (:class:`~kvdi.connectors.base.WorkerGauges`)
        return self._queue.inflight_bytes

    @property
    def staged_bytes(self) -> int | None:  # prefetched bytes in host staging: a gauge; None without staging
        return self.prefetching.staged_bytes

    def prefetch_reports(self) -> list[tuple[str, int]]:  # :class:`~kvdi.connectors.base.PrefetchingWorker`
        if not self.prefetch_reports_due:
            return []  # nothing sent or staged since the last call: no report can have come
        reports = self.prefetching.reports()
        self.prefetch_reports_due = self.staging is not None and bool(self.staging.requests)  # staged: more to come
        self.gauge_epoch += 1
        return reports

    def _cache(self) -> CacheIO:
        return self._cache_ios().io

    def _cache_ios(self) -> CacheIOs:
        if self._ios is None:
            raise RuntimeError(f"connector {self.name!r}: register_kv_caches() was not called before a transfer")
        return self._ios

    def _blocks_per_call(self, io: CacheIO, save: bool = False) -> int:
        """Blocks per store call: about :data:`CHUNK_BYTES` from a CPU cache (saves: a remote store's batch if
        larger), a staging chunk from a device cache."""
        return (max(self._chunk, self._save_batch) if save else self._chunk) if io.direct else io.chunk

    def _overlap(self, io: CacheIO) -> bool:
        """Whether store calls overlap checksums on other threads (``io_thread``; never on a device cache)."""
        use = self.io_thread
        if use is None:
            if self._cpus is None:
                from kvdi.connectors.store.blockio import usable_cpus

                self._cpus = usable_cpus()  # once: sched_getaffinity per request is measurable
            use = self._cpus >= 4
        return io.direct and use

    def _background(self, io: CacheIO, fetch: bool = False) -> ThreadPoolExecutor | None:
        """When transfers overlap: the I/O thread of synchronous transfers, or (``fetch``) background load fetchers."""
        if not self._overlap(io):
            return None
        if fetch and self._fetcher is None:
            name, threads = f"kvdi-{self.name}-fetch", self._queue.load_threads
            self._fetcher = ThreadPoolExecutor(threads, thread_name_prefix=name)
        if not fetch and self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvdi-{self.name}-io")
        return self._fetcher if fetch else self._executor

    def _log_once(self, reason: str, message: str, *args: object) -> None:
        text = f"kv connector %r: {message} (at most once a minute per reason)"
        log_once(logger, self._logged, reason, text, self.name, *args)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Note the requests whose blocks the scheduler half holds for this half, by the rule it holds them by:
        an asynchronous load, or a save while ``transfer.async_save`` is on. Metadata rewritten by an adapter
        into a plain :class:`BlockTransferMetadata` runs synchronously, yet its requests are still reported."""
        super().bind_connector_metadata(metadata)
        self.gauge_epoch += 1
        if isinstance(metadata, StoreTransferMetadata):
            self._held.update(t.request_id for t in metadata.async_loads)
            self.prefetching.apply(metadata.prefetches, metadata.prefetch_drops)
            self.prefetch_reports_due |= bool(metadata.prefetches or metadata.prefetch_drops)
            self._received.update(self.cancels.cancel_all(metadata.load_cancels, self.report_load_error))
        if isinstance(metadata, BlockTransferMetadata) and self._async_save:
            self._held.update(t.request_id for t in metadata.saves)

    # -- background jobs -----------------------------------------------------------------------

    def _collect(self, outcomes: list[Outcome]) -> None:
        """Apply finished jobs on the engine thread: counters, load errors, finished loads."""
        self.gauge_epoch += bool(outcomes)
        for out in outcomes:
            add_stats(self.stats, out.stats)
            if out.is_load and not self.cancels.taken(out.request_id):  # a cancelled load was reported at its cancel
                self.report_load_error(out.failed_blocks)
                if out.request_id not in self._finishing:
                    self._received.add(out.request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished sending: finished requests whose asynchronous jobs are all done; finished receiving: requests whose
        asynchronous load has finished by now (reported in the step it finished in). Nothing queued: at once."""
        if not (self._queue.jobs or self._finishing or self._received or (finished_req_ids and self._held)):
            return None, None
        self.gauge_epoch += 1  # background work in flight may have moved a gauge
        self._collect(self._queue.harvest())
        self._finishing.update(r for r in finished_req_ids if r in self._held)
        sending = {r for r in self._finishing if not self._queue.pending(r)}
        self._finishing -= sending
        self._held -= sending
        received, self._received = self._received, set()
        return sending or None, received or None

    def wait_for_loads(self, timeout_s: float) -> bool:  # up to timeout_s, GIL released; True once a load finished
        staged = self.prefetching.wait(timeout_s, self._queue.loads_in_flight)  # only prefetches in flight
        return self._queue.wait_loads(timeout_s) if staged is None else staged

    def handle_preemptions(self, preempted_req_ids: Collection[str] | None = None) -> None:
        """Finish the jobs of requests whose blocks the engine is about to reuse (vLLM's preemption hook: it frees
        a preempted request's blocks without ``request_finished``); call before the next forward (None: all jobs)."""
        ids = None if preempted_req_ids is None else set(preempted_req_ids)
        wait(self.cancels.preempted_jobs(self._queue.jobs, ids))  # not a cancelled load's stuck store call
        self._collect(self._queue.harvest(loads=False))

    def flush(self) -> None:
        """Wait until every queued transfer is done; save counters are up to date on return."""
        self._queue.wait()
        self._collect(self._queue.harvest(loads=False))

    # -- loads ---------------------------------------------------------------------------------

    def start_load_kv(self) -> None:
        self._collect(self._queue.harvest(loads=True))  # reported with this step's errors and get_finished
        meta = self.metadata
        if not isinstance(meta, BlockTransferMetadata):
            return
        if meta.loads:
            io = self._cache()
            with self.stats.timed("load_seconds"):
                for transfer in meta.loads:
                    self.report_load_error(self._load_request(io, transfer, self.stats, self._background(io)))
        if isinstance(meta, StoreTransferMetadata) and meta.async_loads:
            ios = self._cache_ios()  # the jobs copy into this registration's caches, whenever they run
            fence = ios.io.fence()  # CUDA: the jobs' copies follow the compute queued so far
            fetch = self._background(ios.io, fetch=True)  # made here: job threads never race to make it
            for transfer in meta.async_loads:
                guard = self.cancels.open(transfer, ios.io.order)
                job = partial(self._load_job, ios, transfer, fence, fetch, guard)
                self._queue.submit_load(transfer.request_id, transfer.block_ids, job)

    def _load_job(
        self,
        ios: CacheIOs,
        transfer: BlockTransfer,
        fence: object = None,
        fetch: ThreadPoolExecutor | None = None,
        guard: LoadGuard | None = None,
    ) -> Outcome:
        io = ios.take()
        out = Outcome(transfer.request_id, True)
        try:
            with io.on_side_stream(fence):  # CUDA: a side stream after ``fence``; each chunk waits on its event
                ahead = fetch if io.direct else None
                out.failed_blocks = tuple(self._load_request(io, transfer, out.stats, ahead, guard))
        finally:
            ios.give_back(io)
            self.cancels.close(transfer.request_id, guard)
        return out

    def _load_request(
        self,
        io: CacheIO,
        transfer: BlockTransfer,
        stats: ConnectorStats,
        executor: ThreadPoolExecutor | None,
        guard: LoadGuard | None = None,
    ) -> Sequence[int]:
        """Load one request's blocks chunk by chunk; return the block ids not loaded (from the first bad one on).
        With a ``guard`` (a cancellable load) chunks are placed under its lock (a CPU cache's through host buffers)."""
        ids, keys = transfer.block_ids, transfer.block_keys
        n = self._blocks_per_call(io)
        spans = [(s, min(s + n, len(ids))) for s in range(0, len(ids), n)]
        store, caps = self.prefetching.source(transfer.request_id)
        store, caps = (store, caps) if guard is None or not io.direct else (HostReads(store), STAGED)  # staged: safe
        read = partial(read_chunk, store, caps, self._place, io)
        readahead = Readahead(caps.prefetch, keys, self._readahead)
        ahead = executor.submit(read, ids[: spans[0][1]], keys[: spans[0][1]]) if executor and spans else None
        for k, (start, end) in enumerate(spans):
            readahead.before(start)
            current: Future[ReadChunk] | None = ahead
            if executor is not None and k + 1 < len(spans):
                nxt = spans[k + 1]
                ahead = executor.submit(read, ids[nxt[0] : nxt[1]], keys[nxt[0] : nxt[1]])
            else:
                ahead = None
            io.begin()  # a device cache: the next staging slot (its copies from two chunks ago are done)
            try:
                chunk = current.result() if current is not None else read(ids[start:end], keys[start:end])
            except Exception:  # one by one (a cancellable load's chunk fails whole: no store call under its lock)
                span = slice(start, end)
                good = load_one_by_one(self, io, ids[span], keys[span], stats) if guard is None else failed_chunk(stats)
            else:
                good = placed(guard, partial(self._verify, io, chunk, stats), io)  # 0 once cancelled
            io.submit()  # queue this chunk's copies in; the next chunk's reads overlap them
            if start + good < end:
                io.finish()
                if ahead is not None:
                    wait([ahead])  # it writes into blocks about to be recomputed: let it finish first
                return ids[start + good :]
        io.finish()
        return ()

    def _place(self, frame: memoryview, name: bytes, pieces: Sequence[memoryview]) -> None:
        """Verify a whole frame stored under block key ``name`` and copy its payload into ``pieces``, in one pass."""
        place_frame(frame, pieces, self._fingerprint, self._block_bytes, self._key, name=name)

    def _verify(self, io: CacheIO, chunk: ReadChunk, stats: ConnectorStats) -> int:
        return verify_chunk(
            io, chunk, stats, self._fingerprint, self._block_bytes, self._log_once, self.discard, self._key
        )

    def discard(self, key: bytes) -> None:
        """Drop one bad object from the store; a failure is logged, never raised."""
        if self._block_event is not None:
            self._block_event(False, key)
        try:
            self.store.discard(key)
        except Exception as exc:
            self._log_once("discard", "could not drop a corrupt block: %r", exc)

    # -- saves ---------------------------------------------------------------------------------

    def wait_for_save(self) -> None:
        """Synchronous: return when the step's saves are written. Asynchronous: queue them (waiting only
        while queued saves hold more than ``transfer.max_inflight_bytes``) and return: a device cache's
        copy-out runs in the save job, on a side stream after this step's forward (never on this thread)."""
        meta = self.metadata
        if not isinstance(meta, BlockTransferMetadata) or not meta.saves:
            return
        ios = self._cache_ios()
        with self.stats.timed("save_seconds"):
            if isinstance(meta, StoreTransferMetadata) and meta.async_save:
                self._collect(self._queue.harvest(loads=False))
                fence = ios.io.fence()  # CUDA: everything queued on the engine's stream so far, this forward too
                for transfer in meta.saves:
                    self._queue_save(ios, fence, transfer)
            else:
                self._save_now(ios.io, meta.saves)

    def _queue_save(self, ios: CacheIOs, fence: object, transfer: BlockTransfer) -> None:
        ids, keys, chunk = transfer.block_ids, transfer.block_keys, self._blocks_per_call(ios.io, save=True)
        for start in range(0, len(ids), chunk):
            span = slice(start, start + chunk)
            job = partial(self._save_job, ios, fence, transfer.request_id, ids[span], keys[span])
            self._queue.submit_save(transfer.request_id, len(ids[span]) * self._block_bytes, ids[span], job)

    def _save_job(
        self, ios: CacheIOs, fence: object, request_id: str, ids: Sequence[int], keys: Sequence[bytes]
    ) -> Outcome:
        """One chunk of an asynchronous save, on the save thread. A device cache's blocks are copied out on the
        side stream after ``fence``, and this thread (not the engine's) waits for them: the blocks are held
        (``delay_free``, flushed on preemption) until the job is done, so their bytes are still the step's."""
        out = Outcome(request_id, False)
        io = ios.take()
        try:
            with io.on_side_stream(fence):
                pieces = io.save_pieces(ids)
            self._writer.settle(out.stats, len(keys), self._writer.call(pieces, keys), keys)
        finally:
            ios.give_back(io)
        return out

    def _save_now(self, io: CacheIO, saves: Sequence[BlockTransfer]) -> None:
        executor = self._background(io)
        ids = [b for t in saves for b in t.block_ids]
        keys = [k for t in saves for k in t.block_keys]
        n = self._blocks_per_call(io, save=True)
        spans = [slice(s, s + n) for s in range(0, len(ids), n)]
        tickets = [io.start_save(ids[spans[0]])] if spans else []
        writing: tuple[Future[object], Sequence[bytes]] | None = None
        for k, span in enumerate(spans):
            pieces = io.saved(tickets[k])
            if k + 1 < len(spans):
                tickets.append(io.start_save(ids[spans[k + 1]]))  # a device cache: copied out while this is written
            call = self._writer.call(pieces, keys[span])
            if executor is None:
                self._writer.settle(self.stats, len(keys[span]), call, keys[span])
                continue
            if writing is not None:
                self._writer.settle(self.stats, len(writing[1]), writing[0].result, writing[1])
            writing = (executor.submit(call), keys[span])
        if writing is not None:
            self._writer.settle(self.stats, len(writing[1]), writing[0].result, writing[1])

    def shutdown(self) -> None:
        """Finish every queued transfer, then stop the threads."""
        self.flush()
        self._queue.shutdown()
        self.prefetching.shutdown()
        for pool in (self._executor, self._fetcher):
            if pool is not None:
                pool.shutdown(wait=True)
        self._executor = self._fetcher = None
        self._ios = None


__all__ = ["CHUNK_BYTES", "READAHEAD_BYTES", "StoreWorkerConnector"]
