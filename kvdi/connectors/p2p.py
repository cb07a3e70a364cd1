"""The ``p2p`` connector: a prefill engine (``kv_producer``) hands KV to a decode engine (``kv_consumer``).

Both halves of an engine share one :class:`~kvdi.connectors.p2p_channel.P2pChannel`,
opened once per container by :func:`open_channel` (gloo on CPU, NCCL when the cache is on
CUDA; the producer, rank 0, hosts the TCPStore rendezvous on ``kv_ip:kv_port``).

- Producer: the scheduler half plans a save of each prompt block once it is computed (up
  to the blocks a consumer may load); the worker half frames those blocks (the same format
  every store uses) into host memory and holds them, published under the block keys of
  :mod:`kvdi.connectors.keys`, until the consumer confirms or ``hold_s`` passes.
- Consumer: the scheduler half offers the published prefix of a prompt; the worker half
  fetches all of a step's blocks in one batch (one request; each layer comes as messages
  of a few MiB, received straight into the paged cache when the target blocks are
  consecutive), and verifies every block against its frame header. Missing, corrupt or
  failed blocks (peer gone, timeout) go to
  :meth:`~kvdi.connectors.base.WorkerConnector.report_load_error`, so the engine
  recomputes them per ``kv_load_failure_policy``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorMetadata,
    KVRequest,
    SchedulerConnector,
    SchedulerOutput,
    WorkerConnector,
    loadable_tokens,
)
from kvdi.connectors.keys import block_keys
from kvdi.errors import ConfigError, ConnectorTypeError, KvdiError

if TYPE_CHECKING:
    import torch

    from kvdi.connectors.p2p_channel import P2pChannel
    from kvdi.connectors.p2p_frames import CacheReceiver
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import KvdiSettings, P2pSettings

logger = logging.getLogger(__name__)


class P2pHandshakeError(KvdiError):
    """The two p2p peers could not agree: no peer, a busy port, or a foreign KV layout or backend."""


class P2pTransferError(KvdiError):
    """A p2p fetch failed (peer gone, timeout); the engine recomputes the blocks."""


def open_channel(options: P2pSettings, layout: KVCacheSpec, settings: KvdiSettings) -> P2pChannel:
    """Backend factory of the ``p2p`` spec: rendezvous, handshake and process group (blocks up to ``timeout_s``)."""
    from kvdi.allocator import resolve_device
    from kvdi.connectors.p2p_channel import CONSUMER_RANK, PRODUCER_RANK, P2pChannel

    if settings.kv_role == "kv_both":
        raise ConfigError(
            "KVDI_KV_ROLE='kv_both' is not supported by the p2p connector: run one engine with "
            "kv_role=kv_producer (KVDI_P2P__KV_RANK=0) and one with kv_role=kv_consumer (KVDI_P2P__KV_RANK=1)"
        )
    producer = settings.kv_role == "kv_producer"
    want = PRODUCER_RANK if producer else CONSUMER_RANK
    if options.kv_rank != want or options.kv_parallel_size != 2:
        raise ConfigError(
            f"p2p pairs one producer (rank {PRODUCER_RANK}) with one consumer (rank {CONSUMER_RANK}): "
            f"kv_role={settings.kv_role} needs KVDI_P2P__KV_RANK={want} and KVDI_P2P__KV_PARALLEL_SIZE=2, "
            f"got kv_rank={options.kv_rank}, kv_parallel_size={options.kv_parallel_size}"
        )
    device = resolve_device(settings.allocator.device)
    return P2pChannel(
        options,
        layout,
        producer=producer,
        backend=pick_backend(options, device),
        device=device,
        engine_id=settings.engine_id,
    )


def pick_backend(options: P2pSettings, device: str) -> Literal["gloo", "nccl"]:
    """``gloo`` for a CPU cache, ``nccl`` for a CUDA one (``auto``); raises ConfigError for NCCL without CUDA."""
    if options.backend == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    if options.backend == "nccl" and not device.startswith("cuda"):
        raise ConfigError(
            f"KVDI_P2P__BACKEND='nccl' needs the KV cache on CUDA, but it is on {device!r} "
            "(KVDI_ALLOCATOR__DEVICE); use backend 'gloo' or 'auto'"
        )
    return options.backend


def require_channel(context: ConnectorContext) -> P2pChannel:
    """The shared channel of ``context``; ConnectorTypeError if the container built something else."""
    from kvdi.connectors.p2p_channel import P2pChannel

    if not isinstance(context.backend, P2pChannel):
        raise ConnectorTypeError(
            f"connector {context.name!r} needs a P2pChannel backend (kvdi.connectors.p2p:open_channel), "
            f"got {type(context.backend).__name__}"
        )
    return context.backend


@dataclass
class _Plan:
    """What the scheduler half knows about one request: keys of its loadable blocks, what is planned."""

    keys: list[bytes]
    computed_tokens: int = 0
    saved: int = 0
    loads: list[BlockTransfer] = field(default_factory=list)


class P2pSchedulerConnector(SchedulerConnector):
    """Producer: plans saves of computed prompt blocks. Consumer: offers the blocks the producer published."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.channel = require_channel(context)
        self._block_size = context.layout.block_size
        self._plans: dict[str, _Plan] = {}
        self._loads: list[BlockTransfer] = []

    def _plan(self, request: KVRequest) -> _Plan:
        plan = self._plans.get(request.request_id)
        if plan is None:
            limit = loadable_tokens(len(request.prompt_token_ids), self._block_size) // self._block_size
            keys = block_keys(request.prompt_token_ids, self.context.layout, request.cache_salt)[:limit]
            plan = self._plans[request.request_id] = _Plan(keys)
        return plan

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self.stats.lookups += 1
        if self.channel.producer:
            return 0, False
        plan = self._plan(request)
        plan.computed_tokens = num_computed_tokens
        held = self.channel.count_published(plan.keys)
        first = num_computed_tokens // self._block_size
        if held <= first:
            return 0, False
        self.stats.lookup_hit_blocks += held - first
        return held * self._block_size - num_computed_tokens, False

    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or self.channel.producer:
            return
        plan = self._plan(request)
        start = plan.computed_tokens // self._block_size
        end = min(start + num_external_tokens // self._block_size, len(plan.keys), len(block_ids))
        if end > start:
            self._loads.append(
                BlockTransfer(request.request_id, tuple(block_ids[start:end]), tuple(plan.keys[start:end]))
            )

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        loads, self._loads = tuple(self._loads), []
        saves: list[BlockTransfer] = []
        if self.channel.producer:
            for sched in output.scheduled:
                plan = self._plan(sched.request)
                done = (sched.num_computed_tokens + sched.num_scheduled_tokens) // self._block_size
                end = min(done, len(plan.keys), len(sched.block_ids))
                if end > plan.saved:
                    span = slice(plan.saved, end)
                    saves.append(
                        BlockTransfer(sched.request.request_id, tuple(sched.block_ids[span]), tuple(plan.keys[span]))
                    )
                    plan.saved = end
        for rid in output.finished_req_ids:
            self._plans.pop(rid, None)
        return BlockTransferMetadata(loads, tuple(saves))

    def request_finished(self, request: KVRequest, block_ids: Sequence[int]) -> tuple[bool, None]:
        self._plans.pop(request.request_id, None)
        return False, None


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
        from kvdi.connectors.p2p_frames import CacheReceiver

        missing = [n for n in self.layout.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches() lacks layers {missing} of the KV layout")
        self._caches = [kv_caches[n] for n in self.layout.layer_names]
        if not self.channel.producer:
            self._receiver = CacheReceiver(self._caches, self.layout, self.channel.wire_device)

    def _log_once(self, reason: str, message: str, *args: object) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning(message, *args)

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
                self._log_once("fetch", "kv connector %r: p2p load failed, recomputing: %s", self.name, exc)
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
                    self._log_once(problem.reason, "kv connector %r: dropped a p2p block: %s", self.name, problem)
        self.channel.finish(answer)
        return good

    # -- producer -----------------------------------------------------------------
    def wait_for_save(self) -> None:
        from kvdi.connectors.p2p_frames import gather_frames

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


__all__ = [
    "P2pHandshakeError",
    "P2pSchedulerConnector",
    "P2pTransferError",
    "P2pWorkerConnector",
    "open_channel",
    "pick_backend",
]
