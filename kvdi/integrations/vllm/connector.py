""":class:`KvdiConnector`: vLLM's ``KVConnectorBase_V1`` over kvdi's connector halves (imports vLLM).

vLLM instantiates it once per role (``cls(vllm_config, role, kv_cache_config)``). On construction it builds kvdi's
settings from the ``kvdi.``-prefixed keys of ``kv_connector_extra_config`` layered over ``KVDI_*`` env
(:mod:`.config`), takes ``kv_role`` and ``engine_id`` from vLLM, derives the :class:`KVCacheSpec` from vLLM's model
and cache config (:mod:`.layout`), and builds kvdi's scheduler or worker half from one container per engine id per
process (:mod:`.shared`). Every vLLM call is translated to kvdi's contract (:mod:`kvdi.connectors.base`).

Failed loads go out through ``get_block_ids_with_load_errors`` and vLLM's own ``kv_load_failure_policy`` decides
between recomputing and failing the request (kvdi's half always reports instead of raising). Counters go out
through ``get_kv_connector_stats`` (deltas per step, keyed by the registered connector name, None when nothing
moved) and, when ``kv_connector_extra_config["kvdi_stats_dir"]`` is set, as cumulative JSON files (:mod:`.stats`).

When a connector's blocks live in the worker's memory (:attr:`~kvdi.registry.ConnectorSpec.process_local`) and vLLM
runs the scheduler in another process, the scheduler half looks blocks up in a :class:`BlockIndex` that the worker
keeps current through vLLM's worker-to-scheduler metadata, bounded by the backend's capacity. Under tensor or
pipeline parallelism each worker rank stores and loads its own slice of every block under its own key, and the
scheduler offers a block only when every rank's slice is stored (:mod:`.parallel`).

Asynchronous loads are reported in the step they finish in, a request ended while parked is freed once
(:mod:`.async_loads`); hits may be prefetched at lookup (:mod:`.prefetch`); vLLM's scheduler sees held saves
(:mod:`.pending`); ``handle_preemptions`` flushes preempted requests' transfers before their blocks are reused.

With vLLM's hybrid KV cache manager (``SupportsHMA``) a model may have several KV cache groups (sliding window,
Mamba beside full attention): each group is planned, keyed and stored on its own, and failed loads go out per
request (:mod:`.groups`, :mod:`.hybrid`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorTransferResults,
        SupportsHMA,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole as VllmRole
    from vllm.logger import init_logger
except ImportError as exc:  # only vLLM loads this module; say what to install if someone else does
    raise ImportError(f"kvdi.integrations.vllm needs vLLM ({exc}); install it with: pip install 'kvdi[vllm]'") from exc

from kvdi.connectors.base import (
    AsyncLoadMetadata,
    BlockTransferMetadata,
    PreemptionAware,
    SchedulerConnector,
    WorkerConnector,
)
from kvdi.errors import ConfigError, KvdiError, KVLoadError
from kvdi.integrations.vllm.async_loads import SchedulerLoads, WorkerLoads
from kvdi.integrations.vllm.block_index import BlockIndex
from kvdi.integrations.vllm.bridge import LayoutBridge
from kvdi.integrations.vllm.config import STATS_DIR_KEY, kvdi_settings_kwargs, needs_block_index, worker_elsewhere
from kvdi.integrations.vllm.envelopes import KvdiConnectorMetadata, KvdiConnectorStats, KvdiWorkerMetadata
from kvdi.integrations.vllm.events import FleetHooks
from kvdi.integrations.vllm.groups import groups_from_vllm
from kvdi.integrations.vllm.halves import open_hybrid, open_single
from kvdi.integrations.vllm.hybrid import HybridScheduler, HybridWorker
from kvdi.integrations.vllm.layout import kvdi_layer_view, layout_from_vllm, ordered_layers, rank_slice
from kvdi.integrations.vllm.pending import HeldSaves, PendingWorkHooks, wait_for_loads
from kvdi.integrations.vllm.prefetch import PrefetchHooks
from kvdi.integrations.vllm.requests import RequestTracker
from kvdi.integrations.vllm.shared import SHARED
from kvdi.integrations.vllm.stats import AdapterStats, StatsReporter, check_engine_id, write_stats_file

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")  # vLLM configures only its own logger tree


class KvdiConnector(FleetHooks, PendingWorkHooks, PrefetchHooks, KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc,unused-ignore]
    """vLLM's KVConnectorBase_V1 over kvdi's connector halves (one role per instance).

    A bad kvdi setting raises a :class:`~kvdi.errors.KvdiError` from the constructor, after
    logging its one-line message (``kvdi: ...``), so vLLM refuses to start with the reason
    in its log.
    """

    def __init__(self, vllm_config: VllmConfig, role: VllmRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        try:
            self._setup(vllm_config, role, kv_cache_config)
        except KvdiError as exc:
            logger.error("kvdi: %s", exc)
            raise

    def _setup(self, vllm_config: VllmConfig, role: VllmRole, kv_cache_config: Any) -> None:
        worker = role != VllmRole.SCHEDULER
        self._shape = rank_slice(vllm_config, worker)
        self.layout = layout_from_vllm(vllm_config, self._shape, worker)
        self._engine_id = str(self._kv_transfer_config.engine_id)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._stats_dir: str | None = extra.get(STATS_DIR_KEY)
        if self._stats_dir:
            check_engine_id(self._engine_id)
        kwargs = kvdi_settings_kwargs(vllm_config)
        container = SHARED.acquire(self._engine_id, kwargs, self.layout)
        self.groups = groups_from_vllm(kv_cache_config) if kv_cache_config is not None else []
        self._tracker = RequestTracker()
        self._index: BlockIndex | None = None
        self._scheduler: SchedulerConnector | None = None
        self._worker: WorkerConnector | None = None
        self.half: SchedulerConnector | WorkerConnector
        try:
            self._index_mode = needs_block_index(container.connector().spec, vllm_config)
            self._held_saves = HeldSaves(best_effort=container.connector().store_halves)
            if len(self.groups) > 1:  # one kvdi container and store half per KV cache group
                args = (self.groups, self.layout, kwargs, self._shape, self._tracker, self._index_mode)
                self.half = open_hybrid(container, worker, *args)
            else:
                elsewhere = worker_elsewhere(vllm_config)
                self.half, self._index = open_single(container, worker, self._shape, self._index_mode, elsewhere)
            if worker:
                self._worker = cast(WorkerConnector, self.half)
            else:
                self._scheduler = cast(SchedulerConnector, self.half)
        except BaseException:
            SHARED.release(self._engine_id)
            raise
        self._step_meta: BlockTransferMetadata | None = None
        self._loads_due = self._saves_due = False
        self._stored_keys: list[bytes] = []
        self._dropped_keys: list[bytes] = []
        self._parked = SchedulerLoads()
        self._layer_names: dict[str, str] = {}
        self._views: dict[str, torch.Tensor] = {}
        self._bridge: LayoutBridge | None = None
        self._num_blocks: int | None = getattr(kv_cache_config, "num_blocks", None)
        self._reporter = StatsReporter(self.half.stats)
        self.counts = AdapterStats()
        self._async = WorkerLoads(self.counts, self.half.context.settings.transfer.idle_load_wait_ms / 1000)
        self._counts_reporter = StatsReporter(self.counts)
        self._fleet_setup(vllm_config, worker)  # events, hit sources, reset, metrics (.events)
        self._prefetch_setup()  # async_load=prefetch (.prefetch)
        self._closed = False
        groups = "; ".join(g.tag() for g in self.groups)
        logger.info(
            "kvdi %r %s half for engine %s: %s; KV cache groups: %d (%s)",
            self.half.name,
            role.name,
            self._engine_id,
            self.layout,
            len(self.groups),
            groups,
        )

    @property
    def scheduler_half(self) -> SchedulerConnector:
        if self._scheduler is None:
            raise RuntimeError("KvdiConnector built for the worker role was called as a scheduler")
        return self._scheduler

    @property
    def worker_half(self) -> WorkerConnector:
        if self._worker is None:
            raise RuntimeError("KvdiConnector built for the scheduler role was called as a worker")
        return self._worker

    # ---------------------------------------------------------------- scheduler role

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvdi can load beyond ``num_computed_tokens`` (vLLM's local prefix-cache hit; 0 for producers)."""
        req = self._fleet_request(self._tracker, request)
        n, load_async = self.scheduler_half.get_num_new_matched_tokens(req, num_computed_tokens)
        if n is None:  # prefetching into host staging: vLLM asks again next step
            return None, False
        self._fleet_looked_up(req, num_computed_tokens, n)
        self._parked.offer(req.request_id, bool(load_async and n))
        return n, bool(load_async and n)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Forward the request's blocks (per KV cache group) and accepted token count to kvdi."""
        ids = blocks.get_block_ids() if blocks is not None else ([],)
        req = self._tracker.request(request)
        if self._parked.allocated(req.request_id, num_external_tokens):
            self.counts.async_load_requests += 1  # vLLM now waits for it in WAITING_FOR_REMOTE_KVS
        if isinstance(self._scheduler, HybridScheduler):
            self._scheduler.allocated(req, ids, num_external_tokens)
        else:
            self.scheduler_half.update_state_after_alloc(req, list(ids[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvdiConnectorMetadata:
        """kvdi's metadata for this step, in vLLM's envelope."""
        output = self._tracker.translate(scheduler_output)
        if self._parked.parked:
            self._parked.scheduled(s.request.request_id for s in output.scheduled)
        preempted = tuple(str(r) for r in getattr(scheduler_output, "preempted_req_ids", None) or ())
        inner = self.scheduler_half.build_connector_meta(output)
        self._fleet_planned(inner, output.finished_req_ids)
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        return KvdiConnectorMetadata(inner, preempted, self._parked.take_unheld(), idle)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Tell kvdi the request ended; returns kvdi's (delay_free, kv_transfer_params)."""
        req = self._tracker.request(request)
        try:
            delay_free, params = self.scheduler_half.request_finished(req, list(block_ids))
        finally:
            self._tracker.forget(req.request_id)
        # Ended while parked for its asynchronous load: vLLM holds the blocks until finished receiving.
        return self._held_saves.finished(req.request_id, self._parked.finished(req.request_id, delay_free)), params

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``SupportsHMA`` hook: :meth:`request_finished` with every group's blocks (kvdi needs none)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def update_connector_output(self, connector_output: Any) -> None:
        """Apply the worker's report of stored and vanished keys to the scheduler's :class:`BlockIndex`."""
        self._fleet_worker_events(connector_output)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._prefetch_reported(meta.prefetched if isinstance(meta, KvdiWorkerMetadata) else ())
        self._held_saves.sent(getattr(connector_output, "finished_sending", None))
        if isinstance(self._scheduler, HybridScheduler):  # recomputed from scratch: store them again
            self._scheduler.load_failed(getattr(connector_output, "failed_recving", None) or ())
        if self._index is not None and isinstance(meta, KvdiWorkerMetadata):
            self._index.add(meta.stored)
            for key in meta.dropped:
                self._index.discard(key)

    # ---------------------------------------------------------------- worker role

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's layers to kvdi's ``layers.<i>`` and hand kvdi's worker half caches in kvdi's layout."""
        if isinstance(self._worker, HybridWorker):  # each group's half takes its own layers (vLLM's names)
            self._worker.register_vllm_caches(kv_caches, self._num_blocks)
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
        self._bridge = LayoutBridge(self._views, self.worker_half)
        logger.info(
            "kvdi: vLLM KV layer %s has shape %s; kvdi block view %s (%s)",
            names[0],
            tuple(kv_caches[names[0]].shape),
            tuple(self._views[expected[0]].shape),
            self._bridge.describe(),
        )

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Hand kvdi's worker half this step's metadata; note whether the step loads or saves anything."""
        super().bind_connector_metadata(connector_metadata)
        self._step_meta, self._loads_due, self._saves_due = None, False, False
        if self._worker is None or not isinstance(connector_metadata, KvdiConnectorMetadata):
            return
        self._async.next_step(connector_metadata.idle)
        if connector_metadata.unheld:
            self._async.unheld(connector_metadata.unheld)
        inner = connector_metadata.inner
        if inner is None:
            return
        if isinstance(inner, BlockTransferMetadata):
            self._step_meta = inner
            self._saves_due = bool(inner.saves)
            for t in inner.async_loads if isinstance(inner, AsyncLoadMetadata) else ():  # end in a later step
                self._async.started(t.request_id, t.block_ids, t.block_keys)
            # Async loads start here and finish in a later step's start_load_kv: call it until reported.
            self._loads_due = bool(inner.loads) or bool(self._async.loading)
        else:  # a connector with its own metadata (p2p): let it see every hook
            self._loads_due = self._saves_due = True
        self._fleet_saw(inner)
        if isinstance(inner, BlockTransferMetadata) and self._shape.sliced:
            inner = self._shape.rekey(inner)  # this rank's slice of each block has its own key
        self._worker.bind_connector_metadata(self._bridge.bind(inner) if self._bridge is not None else inner)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Finish the queued transfers of requests vLLM preempted this step, before the forward pass
        reuses their blocks (vLLM calls this before binding the step's metadata)."""
        if self._worker is None or not isinstance(kv_connector_metadata, KvdiConnectorMetadata):
            return
        preempted = kv_connector_metadata.preempted
        if preempted and isinstance(self._worker, PreemptionAware):
            self._worker.handle_preemptions(preempted)
            self.counts.preempted_flushed += len(preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Run kvdi's loads for this step into vLLM's paged cache (nothing when the step loads nothing)."""
        if self._worker is None or not self._loads_due:
            return
        if self._bridge is not None:
            self._bridge.load(self._start_load)  # through scratch: round by round
        else:
            self._start_load()

    def _start_load(self) -> None:
        assert self._worker is not None
        try:
            self._worker.start_load_kv()
        except KVLoadError as exc:  # kvdi is set to report, but never take the engine down
            logger.warning("kvdi load failed: %s", exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None and self._loads_due:
            self._worker.wait_for_layer_load(self._layer_names.get(layer_name, layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is None or not self._saves_due:
            return
        kvdi_name = self._layer_names.get(layer_name)
        if kvdi_name is not None:
            self._worker.save_kv_layer(kvdi_name, self._views[kvdi_name])

    def wait_for_save(self) -> None:
        if self._worker is None or not self._saves_due:
            return
        failures = self._worker.stats.save_failures
        if self._bridge is not None:
            self._bridge.save(self._worker.wait_for_save)  # through scratch: round by round
        else:
            self._worker.wait_for_save()
        if self._index_mode and self._step_meta is not None and self._worker.stats.save_failures == failures:
            self._stored_keys.extend(k for t in self._step_meta.saves for k in t.block_keys)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        wait_for_loads(self._worker, self._async)  # an empty step: let the loader have the GIL a while
        sending, recving = self._async.reconcile(*self._worker.get_finished(finished_req_ids))
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and with several KV cache groups the requests whose load failed."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed(recving or ()) if isinstance(self._worker, HybridWorker) else set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose kvdi load failed (missing, corrupt, foreign); vLLM recomputes or fails them."""
        if self._bridge is not None:
            errors = self._bridge.take_errors()
        else:
            errors = self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()
        if errors and self._index_mode:
            # A chain stops loading at its first bad block: the rest of it is gone for the scheduler too.
            keys = self._async.block_keys()  # asynchronous loads report their errors in a later step
            for t in self._step_meta.loads if self._step_meta is not None else ():
                keys.update(zip(t.block_ids, t.block_keys, strict=True))
            self._dropped_keys.extend(keys[b] for b in errors if b in keys)
        self._async.loaded.clear()
        return errors

    def build_connector_worker_meta(self) -> KvdiWorkerMetadata | None:
        """Keys stored or found gone (for a :class:`BlockIndex`), prefetches that finished; None when neither."""
        prefetched = self._prefetch_reports()
        if not (self._stored_keys or self._dropped_keys or prefetched):
            return None
        meta = KvdiWorkerMetadata(tuple(self._stored_keys), tuple(self._dropped_keys), prefetched)
        self._stored_keys, self._dropped_keys = [], []
        return meta

    # ---------------------------------------------------------------- both roles

    def get_kv_connector_stats(self) -> KvdiConnectorStats | None:
        """kvdi's counters since the last call, keyed by the registered connector name; None when none moved."""
        from kvdi.integrations.vllm.prom import step_stats

        delta, extra = self._reporter.delta(), self._counts_reporter.delta()
        stats = step_stats(self.half.name, delta, extra, self._fleet.entry({**(delta or {}), **(extra or {})}))
        if stats is not None and self._stats_dir and (delta or extra):
            self._write_stats()
        return stats

    def _write_stats(self) -> None:
        assert self._stats_dir is not None
        role = self.role.name.lower()
        counters = {**self._reporter.as_dict(), **self._counts_reporter.as_dict()}
        write_stats_file(self._stats_dir, self._engine_id, role, self.half.name, counters)

    def shutdown(self) -> None:
        """Write final counters, shut kvdi's half down, release the shared container."""
        if self._closed:
            return
        self._closed = True
        if self._stats_dir:
            self._write_stats()
        try:
            self.half.shutdown()
        finally:
            SHARED.release(self._engine_id)


__all__ = ["KvdiConnector"]
