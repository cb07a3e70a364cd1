"""The p2p worker half: the producer frames saved blocks and holds them for its consumer; the
consumer fetches a step's blocks in one batch, verifies each against its frame header and places it.

Producer: the worker half frames the blocks its scheduler half planned (the same format every
store uses) into host memory and holds them, published under the block keys of
:mod:`kvdi.connectors.keys`, until the consumer confirms or ``hold_s`` passes.
Consumer: all of a step's blocks come in one request; each layer comes as messages of a few
MiB, received straight into the paged cache when the target blocks are consecutive. Missing,
corrupt or failed blocks (peer gone, timeout) go to
:meth:`~kvdi.connectors.base.WorkerConnector.report_load_error`, so the engine recomputes
them per ``kv_load_failure_policy``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvdi.connectors.base import BlockTransferMetadata, ConnectorContext, WorkerConnector
from kvdi.connectors.logging_once import log_once
from kvdi.connectors.p2p.backend import require_channel
from kvdi.connectors.p2p.errors import P2pTransferError

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
        self._caches: list[torch.Tensor] = []
        self._receiver: CacheReceiver | None = None
        self._logged: set[str] = set()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from kvdi.connectors.p2p.frames import CacheReceiver

        missing = [n for n in self.layout.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches() lacks layers {missing} of the KV layout")
        self._caches = [kv_caches[n] for n in self.layout.layer_names]
        if not self.channel.producer:
            self._receiver = CacheReceiver(self._caches, self.layout, self.channel.wire_device)

    # -- consumer -----------------------------------------------------------------
    def start_load_kv(self) -> None:
        meta = self.metadata
        if not isinstance(meta, BlockTransferMetadata) or not meta.loads or self._receiver is None:
            return
        keys = [k for t in meta.loads for k in t.block_keys]
        ids = [b for t in meta.loads for b in t.block_ids]
        with self.stats.timed("load_seconds"):
            try:
                good = self._fetch(self._receiver, keys, ids)
            except P2pTransferError as exc:
                self.stats.load_failures += 1
                log_once(
                    logger, self._logged, "fetch", "kv connector %r: p2p load failed, recomputing: %s", self.name, exc
                )
                good = [False] * len(keys)
        i = 0
        for t in meta.loads:  # a load is usable up to its first bad block; the rest is recomputed
            n = len(t.block_ids)
            ok = good[i : i + n]
            first_bad = ok.index(False) if False in ok else n
            if first_bad < n:
                self.report_load_error(t.block_ids[first_bad:])
            self.stats.loaded_blocks += first_bad
            self.stats.loaded_bytes += first_bad * self.layout.block_bytes
            i += n

    def _fetch(self, receiver: CacheReceiver, keys: Sequence[bytes], ids: Sequence[int]) -> list[bool]:
        """Fetch ``keys`` into cache blocks ``ids``; whether each block arrived intact."""
        answer = self.channel.request(keys)
        rows = [i for i, hit in enumerate(answer.found) if hit]
        good = [False] * len(keys)
        if rows:
            targets = [ids[i] for i in rows]
            buffers, direct = receiver.buffers(targets)
            sink = receiver.receiving(buffers, targets, direct)
            self.channel.receive(answer, buffers, sink)
            for row, problem in zip(rows, sink.verdicts(answer.headers), strict=True):
                good[row] = problem is None
                if problem is not None:
                    self.stats.corrupt_dropped += 1
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
                self.channel.hold(t.block_keys, gather_frames(self._caches, t.block_ids, self.layout))
                self.stats.saved_blocks += len(t.block_ids)
                self.stats.saved_bytes += len(t.block_ids) * self.layout.block_bytes

    def shutdown(self) -> None:
        self._caches = []
        self._receiver = None


__all__ = ["P2pWorkerConnector"]
