"""The worker role of :class:`~.connector.KvdiConnector`: vLLM's worker calls, in kvdi's terms.

:class:`WorkerSide` takes its collaborators in its constructor: kvdi's worker half, the layout
and rank slice of this worker, the fleet side (:class:`~.fleet.events.WorkerFleet`) and the
adapter's counters. It maps vLLM's layers to kvdi's, binds each step's metadata (re-keyed per
rank, through the :class:`~.bridge.LayoutBridge` where blocks are not contiguous), runs the
loads and saves, reports asynchronous loads in the step they finish (:mod:`.async_loads`) and
keeps a :class:`~.block_index.BlockIndex` in the scheduler's process current (``index_mode``).

A step's saves are queued before its finished sends are reported, whichever order vLLM calls
them in: vLLM 0.33's model runner V2 with a drafter asks ``get_transfer_results`` before
``wait_for_save`` (``defer_finalize``), and a request reported sent before its last save was
queued would free blocks a later job still reads. Around vLLM 0.33's sleep mode
(``unregister_kv_caches`` / ``restore_kv_caches``) every queued transfer that touches the KV
cache ends before its memory is released; the views stay registered (vLLM remaps the same
addresses on wake-up).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from kvdi.connectors.base import (
    AsyncLoadMetadata,
    BlockTransfer,
    BlockTransferMetadata,
    PreemptionAware,
    PrefetchingWorker,
    WorkerConnector,
)
from kvdi.errors import ConfigError, KVLoadError
from kvdi.integrations.vllm.async_loads import WorkerLoads
from kvdi.integrations.vllm.bridge import LayoutBridge
from kvdi.integrations.vllm.envelopes import EMPTY_ENVELOPE_IDS, KvdiConnectorMetadata, KvdiWorkerMetadata
from kvdi.integrations.vllm.fleet.events import WorkerFleet
from kvdi.integrations.vllm.fleet.stats import AdapterStats
from kvdi.integrations.vllm.hybrid import HybridWorker
from kvdi.integrations.vllm.layout import kvdi_layer_view, ordered_layers
from kvdi.integrations.vllm.parallel import RankSlice
from kvdi.integrations.vllm.pending import load_waiters, wait_on
from kvdi.layout import KVCacheSpec

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM configures only its own logger tree


@runtime_checkable
class DueReports(Protocol):
    """A :class:`~kvdi.connectors.base.PrefetchingWorker` that says when a report may be waiting (the store worker
    half: prefetches sent or staged since its last report): asked for them only then, not every step."""

    prefetch_reports_due: bool


class WorkerSide:
    """vLLM's worker-role hooks over kvdi's worker half (one step: bind, load, per layer, save, finished)."""

    def __init__(
        self,
        half: WorkerConnector,
        layout: KVCacheSpec,
        shape: RankSlice,
        fleet: WorkerFleet,
        counts: AdapterStats,
        index_mode: bool = False,
        num_blocks: int | None = None,
    ) -> None:
        self.half = half
        self.layout = layout
        self.fleet = fleet
        self.counts = counts
        self._shape = shape
        self._index_mode = index_mode
        self._num_blocks = num_blocks
        self.hybrid = half if isinstance(half, HybridWorker) else None
        self._prefetch_source = half if isinstance(half, PrefetchingWorker) else None
        self._reports_due = half if isinstance(half, DueReports) else None  # None: asked every step
        self._async = WorkerLoads(counts, half.context.settings.transfer.idle_load_wait_ms / 1000)
        self._step_meta: BlockTransferMetadata | None = None
        self.bound = False  # kvdi's half has this step's metadata (cleared after the step)
        # Whether this step loads or saves: the connector reads them before forwarding the per-layer hooks.
        self.loads_due = self.saves_due = False
        self._saves_pending = False  # this step's saves not yet handed to kvdi's half (see wait_for_save)
        self.asleep = False  # between vLLM's unregister_kv_caches and restore_kv_caches
        self._stored_keys: list[bytes] = []
        self._dropped_keys: list[bytes] = []
        self._layer_names: dict[str, str] = {}
        self._views: dict[str, torch.Tensor] = {}
        self._bridge: LayoutBridge | None = None
        self._load_waiters = load_waiters(half)
        self._async_kinds: dict[type, bool] = {}  # metadata type -> has async_loads (AsyncLoadMetadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's layers to kvdi's ``layers.<i>`` and hand kvdi's worker half caches in kvdi's layout."""
        if self.hybrid is not None:  # each group's half takes its own layers (vLLM's names)
            self.hybrid.register_vllm_caches(kv_caches, self._num_blocks)
            return
        names = ordered_layers(list(kv_caches))
        expected = self.layout.layer_names
        if len(names) != len(expected):
            raise ConfigError(f"vLLM registered {len(names)} KV cache layers, the model config says {len(expected)}")
        self._layer_names = dict(zip(names, expected, strict=True))
        self._views = {
            kvdi: kvdi_layer_view(kv_caches[name], self.layout, self._num_blocks)
            for name, kvdi in self._layer_names.items()
        }
        self._bridge = LayoutBridge(self._views, self.half)
        logger.info(
            "kvdi: vLLM KV layer %s has shape %s; kvdi block view %s (%s)",
            names[0],
            tuple(kv_caches[names[0]].shape),
            tuple(self._views[expected[0]].shape),
            self._bridge.describe(),
        )

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Hand kvdi's worker half this step's metadata; note whether the step loads or saves anything. A step
        that moves nothing (:func:`.envelopes.moves_nothing`, by identity) with no asynchronous load in flight
        binds nothing: kvdi's half, which would get an empty metadata, is not called until a step moves a block."""
        self._step_meta, self.loads_due, self.saves_due = None, False, False
        self._saves_pending = False
        loads = self._async
        if id(connector_metadata) in EMPTY_ENVELOPE_IDS and not loads.loading:  # moves_nothing(), inlined
            loads.step += 1
            loads.idle = False
            return
        if not isinstance(connector_metadata, KvdiConnectorMetadata):
            return
        loads.next_step(connector_metadata.idle)
        if connector_metadata.unheld:
            loads.unheld(connector_metadata.unheld)
        inner = connector_metadata.inner
        if inner is None:
            return
        if isinstance(inner, BlockTransferMetadata):
            self._step_meta = inner
            self.saves_due = bool(inner.saves)
            for t in self._async_loads_of(inner):  # end in a later step
                loads.started(t.request_id, t.block_ids, t.block_keys)
            # Async loads start here and finish in a later step's start_load_kv: call it until reported.
            self.loads_due = bool(inner.loads) or bool(loads.loading)
        else:  # a connector with its own metadata (p2p): let it see every hook
            self.loads_due = self.saves_due = True
        self._saves_pending = self.saves_due
        self.fleet.saw(inner)
        if isinstance(inner, BlockTransferMetadata) and self._shape.sliced:
            inner = self._shape.rekey(inner)  # this rank's slice of each block has its own key
        self.half.bind_connector_metadata(self._bridge.bind(inner) if self._bridge is not None else inner)
        self.bound = True

    def _async_loads_of(self, inner: BlockTransferMetadata) -> tuple[BlockTransfer, ...]:
        """``inner.async_loads`` when its type has them; the protocol check (slow: it walks the protocol's members)
        runs once per metadata type, not once per step."""
        kind = type(inner)
        has = self._async_kinds.get(kind)
        if has is None:
            has = self._async_kinds[kind] = isinstance(inner, AsyncLoadMetadata)
        return cast(AsyncLoadMetadata, inner).async_loads if has else ()

    def clear_connector_metadata(self) -> None:
        """Clear kvdi's half's metadata after the step (nothing to clear when this step bound none)."""
        if self.bound:
            self.bound = False
            self.half.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Finish the queued transfers of requests vLLM preempted this step, before the forward pass
        reuses their blocks (vLLM calls this before binding the step's metadata)."""
        if not isinstance(kv_connector_metadata, KvdiConnectorMetadata):
            return
        preempted = kv_connector_metadata.preempted
        if preempted and isinstance(self.half, PreemptionAware):
            self.half.handle_preemptions(preempted)
            self.counts.preempted_flushed += len(preempted)

    def start_load_kv(self) -> None:
        """Run kvdi's loads for this step into vLLM's paged cache (nothing when the step loads nothing)."""
        if not self.loads_due:
            return
        if self._bridge is not None:
            self._bridge.load(self._start_load)  # through scratch: round by round
        else:
            self._start_load()

    def _start_load(self) -> None:
        try:
            self.half.start_load_kv()
        except KVLoadError as exc:  # kvdi is set to report, but never take the engine down
            logger.warning("kvdi load failed: %s", exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.loads_due:
            self.half.wait_for_layer_load(self._layer_names.get(layer_name, layer_name))

    def save_kv_layer(self, layer_name: str) -> None:
        if not self.saves_due:
            return
        kvdi_name = self._layer_names.get(layer_name)
        if kvdi_name is not None:
            self.half.save_kv_layer(kvdi_name, self._views[kvdi_name])

    def wait_for_save(self) -> None:
        """Hand this step's saves to kvdi's half, once per step: a second call (vLLM's deferred finalize after
        :meth:`get_finished` already did it) does nothing."""
        if not self._saves_pending:
            return
        self._saves_pending = False
        failures = self.half.stats.save_failures
        if self._bridge is not None:
            self._bridge.save(self.half.wait_for_save)  # through scratch: round by round
        else:
            self.half.wait_for_save()
        if self._index_mode and self._step_meta is not None and self.half.stats.save_failures == failures:
            self._stored_keys.extend(k for t in self._step_meta.saves for k in t.block_keys)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous saves and loads ended; the step's saves are queued first when vLLM asks
        before ``wait_for_save`` (0.33's deferred finalize), so no request is reported sent before its last save
        was even queued."""
        if self._saves_pending:
            self.wait_for_save()
        loads = self._async
        if loads.idle and self._load_waiters:
            wait_on(self._load_waiters, loads)  # an empty step: let the loader have the GIL a while
        sending, recving = self.half.get_finished(finished_req_ids)
        if not (sending or recving or loads.unheld_ids):
            return None, None
        sending, recving = loads.reconcile(sending, recving)
        return sending or None, recving or None

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's hook before sleep releases the KV cache's memory: every queued transfer of kvdi's half that
        reads or writes the cache ends first (vLLM drained its requests; kvdi's own queue may still hold jobs).
        Idempotent; kvdi's store keeps what it holds."""
        if isinstance(self.half, PreemptionAware):
            self.half.handle_preemptions(None)  # None: every request's jobs
        self.asleep = True

    def restore_kv_caches(self) -> None:
        """vLLM 0.33's hook after wake-up: the views kvdi registered address the same memory again. Idempotent."""
        self.asleep = False

    def failed_requests(self, recving: set[str] | None) -> set[str]:
        """With several KV cache groups, the requests reported received now whose load failed."""
        return self.hybrid.take_failed(recving or ()) if self.hybrid is not None else set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose kvdi load failed (missing, corrupt, foreign); vLLM recomputes or fails them."""
        bridge = self._bridge
        errors = bridge.take_errors() if bridge is not None else self.half.get_block_ids_with_load_errors()
        if errors and self._index_mode:
            # A chain stops loading at its first bad block: the rest of it is gone for the scheduler too.
            keys = self._async.block_keys()  # asynchronous loads report their errors in a later step
            for t in self._step_meta.loads if self._step_meta is not None else ():
                keys.update(zip(t.block_ids, t.block_keys, strict=True))
            self._dropped_keys.extend(keys[b] for b in errors if b in keys)
        if self._async.loaded:
            self._async.loaded.clear()
        return errors

    def build_connector_worker_meta(self) -> KvdiWorkerMetadata | None:
        """Keys stored or found gone (for a :class:`BlockIndex`), prefetches that finished; None when neither."""
        due = self._reports_due
        source = self._prefetch_source if due is None or due.prefetch_reports_due else None
        prefetched = tuple(source.prefetch_reports()) if source is not None else ()
        if not (self._stored_keys or self._dropped_keys or prefetched):
            return None
        meta = KvdiWorkerMetadata(tuple(self._stored_keys), tuple(self._dropped_keys), prefetched)
        self._stored_keys, self._dropped_keys = [], []
        return meta


__all__ = ["WorkerSide"]
