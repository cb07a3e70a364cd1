"""The p2p worker half: the producer frames saved blocks and holds them for its consumer; the
consumer fetches a step's blocks in one batch, verifies each against its frame header and places it.

Producer: the worker half copies the blocks its scheduler half planned out of the cache into
host frames (the same format every store uses; MACed with ``KVDI_INTEGRITY_KEY`` when set)
during ``wait_for_save``, and holds them, published under the block keys of
:mod:`kvdi.connectors.store.keys`, until the consumer confirms or ``hold_s`` passes. Nothing reads
a cache block after ``wait_for_save`` returns, so the engine may reuse it at once.
Consumer: a step's synchronous loads come in one request; each layer comes as messages of a
few MiB, received straight into the paged cache when the target blocks are consecutive.
Asynchronous loads (:class:`~kvdi.connectors.p2p.scheduler.P2pTransferMetadata`) are fetched
the same way on a background thread (one fetch at a time), started by ``start_load_kv``; the
next ``start_load_kv`` after a fetch ended reports its failed blocks and ``get_finished`` the
request (finished receiving). Missing, corrupt or failed blocks (peer gone, timeout, a frame
without a valid MAC under the key) go to
:meth:`~kvdi.connectors.base.WorkerConnector.report_load_error`, so the engine recomputes
them per ``kv_load_failure_policy``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Mapping, Sequence
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
from kvdi.connectors.p2p.backend import require_channel
from kvdi.connectors.p2p.errors import P2pTransferError
from kvdi.connectors.p2p.scheduler import P2pTransferMetadata
from kvdi.connectors.store.integrity import frame_key
from kvdi.connectors.store.transfer_queue import Outcome, TransferQueue, add_stats
from kvdi.connectors.streams import StreamOrder, order_for

if TYPE_CHECKING:
    import torch

    from kvdi.connectors.p2p.frames import CacheReceiver

logger = logging.getLogger(__name__)


class P2pWorkerConnector(WorkerConnector):
    """Producer: frames and holds saved blocks. Consumer: fetches, verifies and places loaded blocks."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.channel = require_channel(context)
        self.layout = context.layout
        self._key = frame_key(context.settings)  # None unless KVDI_INTEGRITY_KEY(_FILE) is set
        self._caches: list[torch.Tensor] = []
        self._receiver: CacheReceiver | None = None
        self._queue = TransferQueue(self.name, context.settings.transfer.max_inflight_bytes)
        self._held: set[str] = set()  # requests with an asynchronous load: reported once finished and done
        self._finishing: set[str] = set()
        self._received: set[str] = set()
        self._logged: set[str] = set()
        self._order: StreamOrder | None = None  # a CUDA cache: copies ordered against the engine's stream
        self._staged: object = None  # event after the last fetch's copies out of staging
        self._blocks_per_fetch = max(1, context.settings.allocator.max_staging_bytes // self.layout.block_bytes)

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from kvdi.connectors.p2p.frames import CacheReceiver

        missing = [n for n in self.layout.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches() lacks layers {missing} of the KV layout")
        self._caches = [kv_caches[n] for n in self.layout.layer_names]
        if self._order is None:
            self._order = order_for(self._caches[0].device)
        if not self.channel.producer:
            self._receiver = CacheReceiver(
                self._caches, self.layout, self.channel.wire_device, self.context.staging, self._key, self._order
            )

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Note the requests whose blocks the scheduler half holds for this half (an asynchronous load)."""
        super().bind_connector_metadata(metadata)
        if isinstance(metadata, P2pTransferMetadata):
            self._held.update(t.request_id for t in metadata.async_loads)

    # -- consumer -----------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Report the asynchronous loads that ended, fetch this step's synchronous loads, start its async ones."""
        self._collect(self._queue.harvest(loads=True))
        meta = self.metadata
        if not isinstance(meta, BlockTransferMetadata) or self._receiver is None:
            return
        if meta.loads:
            with self.stats.timed("load_seconds"):
                self.report_load_error(self._load(self._receiver, meta.loads, self.stats))
        if isinstance(meta, P2pTransferMetadata) and meta.async_loads:
            fence = self._order.fence() if self._order is not None else None  # the compute queued so far
            for t in meta.async_loads:
                self._queue.submit_load(t.request_id, t.block_ids, partial(self._load_job, self._receiver, t, fence))

    def _load_job(self, receiver: CacheReceiver, transfer: BlockTransfer, fence: object = None) -> Outcome:
        """One asynchronous load, on the background thread; its counters and failed blocks in the outcome.

        On a CUDA cache its copies run on a side stream after ``fence`` (a reused block's old owner's
        writes land first), and the job waits for them before the request is reported."""
        out = Outcome(transfer.request_id, True)
        side = self._order.side(fence) if self._order is not None else contextlib.nullcontext()
        with out.stats.timed("load_seconds"), side:
            out.failed_blocks = tuple(self._load(receiver, (transfer,), out.stats))
            self._settle_copies()
        return out

    def _settle_copies(self) -> None:
        """Wait (host) for this thread's queued copies into the cache; nothing on a CPU cache."""
        if self._order is not None:
            self._order.wait()
            self._staged = None

    def _collect(self, outcomes: list[Outcome]) -> None:
        """Apply ended asynchronous loads on the engine thread: counters, load errors, finished receiving."""
        for out in outcomes:
            add_stats(self.stats, out.stats)
            self.report_load_error(out.failed_blocks)
            if out.request_id not in self._finishing:
                self._received.add(out.request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished sending: finished requests whose asynchronous load ended (their blocks may be freed);
        finished receiving: requests whose asynchronous load the step's ``start_load_kv`` collected."""
        self._finishing.update(r for r in finished_req_ids if r in self._held)
        sending = {r for r in self._finishing if not self._queue.pending(r)}
        self._finishing -= sending
        self._held -= sending
        received, self._received = self._received, set()
        return sending or None, received or None

    def _load(self, receiver: CacheReceiver, transfers: Sequence[BlockTransfer], stats: ConnectorStats) -> list[int]:
        """Fetch ``transfers`` in one batch; the block ids not loaded (each transfer from its first bad block)."""
        keys = [k for t in transfers for k in t.block_keys]
        ids = [b for t in transfers for b in t.block_ids]
        if not keys:  # a layout bridge's marker: the blocks were loaded synchronously, only the report is left
            return []
        good: list[bool] = []
        step = self._blocks_per_fetch
        try:
            for a in range(0, len(keys), step):  # a fetch's staging stays under allocator.max_staging_bytes
                good += self._fetch(receiver, keys[a : a + step], ids[a : a + step], stats)
        except P2pTransferError as exc:
            stats.load_failures += 1
            log_once(logger, self._logged, "fetch", "kv connector %r: p2p load failed, recomputing: %s", self.name, exc)
        good += [False] * (len(keys) - len(good))
        failed: list[int] = []
        i = 0
        for t in transfers:  # a load is usable up to its first bad block; the rest is recomputed
            n = len(t.block_ids)
            ok = good[i : i + n]
            first_bad = ok.index(False) if False in ok else n
            failed.extend(t.block_ids[first_bad:])
            stats.loaded_blocks += first_bad
            stats.loaded_bytes += first_bad * self.layout.block_bytes
            i += n
        return failed

    def _fetch(
        self, receiver: CacheReceiver, keys: Sequence[bytes], ids: Sequence[int], stats: ConnectorStats
    ) -> list[bool]:
        """Fetch ``keys`` into cache blocks ``ids``; whether each block arrived intact."""
        answer = self.channel.request(keys)
        rows = [i for i, hit in enumerate(answer.found) if hit]
        good = [False] * len(keys)
        if rows:
            targets = [ids[i] for i in rows]
            buffers, direct = receiver.buffers(targets)
            if not direct and self._staged is not None:  # staging is reused: the last copies out of it ran
                self._staged.synchronize()  # type: ignore[attr-defined]
                self._staged = None
            sink = receiver.receiving(buffers, targets, direct, [keys[i] for i in rows])
            try:
                self.channel.receive(answer, buffers, sink)
            finally:
                if not direct and self._order is not None:
                    self._staged = self._order.mark()
            for row, problem in zip(rows, sink.verdicts(answer.headers), strict=True):
                good[row] = problem is None
                if problem is not None:
                    stats.corrupt_dropped += 1
                    log_once(
                        logger,
                        self._logged,
                        problem.reason,
                        "kv connector %r: dropped a p2p block: %s",
                        self.name,
                        problem,
                    )
        self.channel.finish(answer)
        return good

    # -- producer -----------------------------------------------------------------
    def wait_for_save(self) -> None:
        from kvdi.connectors.p2p.frames import gather_frames

        meta = self.metadata
        if not isinstance(meta, BlockTransferMetadata) or not meta.saves or not self.channel.producer:
            return
        with self.stats.timed("save_seconds"):
            for t in meta.saves:
                if self.channel.broken is not None:
                    self.stats.save_failures += 1
                    continue
                self.channel.hold(
                    t.block_keys, gather_frames(self._caches, t.block_ids, self.layout, self._key, names=t.block_keys)
                )
                self.stats.saved_blocks += len(t.block_ids)
                self.stats.saved_bytes += len(t.block_ids) * self.layout.block_bytes

    def handle_preemptions(self, preempted_req_ids: Collection[str] | None = None) -> None:
        """Wait for the asynchronous loads of requests whose blocks the engine takes back (vLLM's
        preemption hook; None: every load), so no fetch writes into a reused block."""
        self._queue.wait(None if preempted_req_ids is None else set(preempted_req_ids))

    def flush(self) -> None:
        """Wait until every asynchronous load ended (each is bounded by ``KVDI_P2P__TIMEOUT_S``)."""
        self._queue.wait()

    def shutdown(self) -> None:
        """Let running fetches end (they write into the cache), then stop the thread."""
        self.flush()
        self._queue.shutdown()
        self._caches = []
        self._receiver = None


__all__ = ["P2pWorkerConnector"]
