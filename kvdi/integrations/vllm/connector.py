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

The connector is thin: it builds the role's side, :class:`~.scheduler_side.SchedulerSide` or
:class:`~.worker_side.WorkerSide`, each with its collaborators (kvdi's half, the fleet side of :mod:`.fleet`), and
forwards vLLM's calls to it.

vLLM 0.33's sleep mode (:meth:`KvdiConnector.supports_sleep_mode`, ``unregister_kv_caches`` /
``restore_kv_caches``): kvdi supports it; before the KV cache's memory is released every queued
transfer of kvdi's half ends, and kvdi's stores keep what they hold. vLLM resets the connector
on every sleep of level 1 or more (``reset_prefix_cache(reset_connector=True)``), so the engine
is offered nothing stored before it (see ``docs/vllm-0.33.md``). The same code runs on 0.32,
which never calls these hooks.

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

from kvdi.connectors.base import SchedulerConnector, WorkerConnector
from kvdi.errors import KvdiError
from kvdi.integrations.vllm.block_index import BlockIndex
from kvdi.integrations.vllm.config import (
    STATS_DIR_KEY,
    adopt_load_failure_policy,
    kvdi_settings_kwargs,
    needs_block_index,
    renamed_for_transfer_config,
    worker_elsewhere,
)
from kvdi.integrations.vllm.envelopes import KvdiConnectorMetadata, KvdiConnectorStats, KvdiWorkerMetadata
from kvdi.integrations.vllm.fleet.counters import FleetCounters
from kvdi.integrations.vllm.fleet.events import KvdiKVEvents, SchedulerFleet, WorkerFleet, events_enabled
from kvdi.integrations.vllm.fleet.prom import FleetConnectorStats, step_stats
from kvdi.integrations.vllm.fleet.stats import AdapterStats, StatsFileWriter, StatsReporter, StepDeltas, check_engine_id
from kvdi.integrations.vllm.groups import groups_from_vllm
from kvdi.integrations.vllm.halves import open_hybrid, open_single
from kvdi.integrations.vllm.layout import layout_from_vllm, rank_slice
from kvdi.integrations.vllm.pending import HeldSaves
from kvdi.integrations.vllm.prefetch import prefetch_unavailable, start_prefetch
from kvdi.integrations.vllm.requests import RequestTracker
from kvdi.integrations.vllm.scheduler_side import SchedulerSide
from kvdi.integrations.vllm.shared import SHARED
from kvdi.integrations.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

logger = init_logger(f"vllm.{__name__}")  # vLLM configures only its own logger tree


class KvdiConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc,unused-ignore]
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
            logger.error("kvdi: %s", renamed_for_transfer_config(exc, vllm_config))
            raise

    def _setup(self, vllm_config: VllmConfig, role: VllmRole, kv_cache_config: Any) -> None:
        worker = role != VllmRole.SCHEDULER
        shape = rank_slice(vllm_config, worker)
        self.layout = layout_from_vllm(vllm_config, shape, worker)
        self._engine_id = str(self._kv_transfer_config.engine_id)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._stats_dir: str | None = extra.get(STATS_DIR_KEY)
        if self._stats_dir:
            check_engine_id(self._engine_id)
        kwargs = kvdi_settings_kwargs(vllm_config)
        container = SHARED.acquire(self._engine_id, kwargs, self.layout)
        self.groups = groups_from_vllm(kv_cache_config) if kv_cache_config is not None else []
        tracker = RequestTracker()
        index: BlockIndex | None = None
        try:
            adopt_load_failure_policy(vllm_config)  # kvdi's policy is vLLM's: a bad stored block is a miss
            index_mode = needs_block_index(container.connector().spec, vllm_config)
            self._held_saves = HeldSaves(best_effort=container.connector().store_halves)
            if len(self.groups) > 1:  # one kvdi container and store half per KV cache group
                args = (self.groups, self.layout, kwargs, shape, tracker, index_mode)
                self.half: SchedulerConnector | WorkerConnector = open_hybrid(container, worker, *args)
            else:
                elsewhere = worker_elsewhere(vllm_config)
                self.half, index = open_single(container, worker, shape, index_mode, elsewhere)
        except BaseException:
            SHARED.release(self._engine_id)
            raise
        self.counts = AdapterStats()
        self._reporter = StatsReporter(self.half.stats)
        self._counts_reporter = StatsReporter(self.counts)
        self._deltas = StepDeltas(self._reporter, self._counts_reporter)
        self._stats_file: StatsFileWriter | None = None
        if self._stats_dir:
            role_name = role.name.lower()
            self._stats_file = StatsFileWriter(
                self._stats_dir, self._engine_id, role_name, self.half.name, self._counters
            )
        events_on = events_enabled(vllm_config)
        # The other role's side answers every access with a RuntimeError (:class:`_WrongRole`); the hooks reach
        # their own side with no check of their own.
        self._scheduler_side: SchedulerSide = cast(SchedulerSide, _WrongRole("worker", "scheduler"))
        self._worker_side: WorkerSide = cast(WorkerSide, _WrongRole("scheduler", "worker"))
        self._fleet_counters: FleetCounters
        if worker:
            half = cast(WorkerConnector, self.half)
            num_blocks: int | None = getattr(kv_cache_config, "num_blocks", None)  # vLLM's config
            worker_fleet = WorkerFleet(half, shape, events_on)
            self._worker_side = WorkerSide(half, self.layout, shape, worker_fleet, self.counts, index_mode, num_blocks)
            self._fleet_counters = worker_fleet.counters
        else:
            sched = cast(SchedulerConnector, self.half)
            fleet = SchedulerFleet(sched, self.layout, shape, tracker, events_on, kv_cache_config, vllm_config)
            prefetcher = start_prefetch(sched, prefetch_unavailable(len(self.groups), shape, index_mode))
            self._scheduler_side = SchedulerSide(
                sched, tracker, fleet, self._held_saves, self.counts, index, prefetcher
            )
            self._fleet_counters = fleet.counters
        self._role_is_worker = worker
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
    def scheduler_side(self) -> SchedulerSide:
        """The scheduler role's side (a RuntimeError on any use in the worker role)."""
        return self._scheduler_side

    @property
    def worker_side(self) -> WorkerSide:
        """The worker role's side (a RuntimeError on any use in the scheduler role)."""
        return self._worker_side

    @property
    def scheduler_half(self) -> SchedulerConnector:
        return self.scheduler_side.half

    @property
    def worker_half(self) -> WorkerConnector:
        return self.worker_side.half

    # ---------------------------------------------------------------- scheduler role: forwarded

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvdi can load beyond ``num_computed_tokens``; None while a hit is prefetched (ask again)."""
        return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvdiConnectorMetadata:
        return self._scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``SupportsHMA`` hook: :meth:`request_finished` with every group's blocks (kvdi needs none)."""
        return self._scheduler_side.request_finished(request, list(block_ids[0]) if block_ids else [])

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side.update_connector_output(connector_output)

    def has_pending_block_frees(self) -> bool:
        """True while a store connector holds blocks of finished requests for queued saves (see :mod:`.pending`)."""
        return self._held_saves.pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._scheduler_side.has_pending_push_work()

    @property
    def requires_kv_delivery(self) -> bool:
        """False for the store connectors (a best-effort cache), True otherwise (p2p delivers to a peer)."""
        return self._held_saves.requires_kv_delivery

    def take_events(self) -> list[Any]:
        """vLLM's hook: kvdi's KV cache events since the last call (published with vLLM's own)."""
        return self._scheduler_side.fleet.take_events()

    def reset_cache(self) -> bool:
        """vLLM's hook (``reset_prefix_cache(reset_connector=True)``): stop offering what was stored before it."""
        return self.scheduler_side.fleet.reset_cache()

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """vLLM's hook: ``num_external_tokens`` split by the kind of tier that serves them."""
        return self.scheduler_side.fleet.hit_sources(request, num_external_tokens)

    # ---------------------------------------------------------------- worker role: forwarded

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's layers to kvdi's ``layers.<i>`` and hand kvdi's worker half caches in kvdi's layout."""
        self.worker_side.register_kv_caches(kv_caches)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33's check at config time (``--enable-sleep-mode``): True. kvdi pins no device memory with
        anything outside the process (no RDMA or IPC registration), its views address the KV cache by the virtual
        addresses vLLM's sleep allocator remaps on wake-up, and :meth:`unregister_kv_caches` ends its queued
        transfers before the memory goes."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's hook before sleep (and ``discard(("kv_cache",))``): end every queued transfer of kvdi's half
        that touches the KV cache. The scheduler role registers nothing: nothing to do there."""
        if self._role_is_worker:
            self._worker_side.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33's hook after wake-up with the KV cache: kvdi's views address it again (same addresses)."""
        if self._role_is_worker:
            self._worker_side.restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker_side.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        side = self._worker_side
        if side.bound:  # kvdi's half got metadata this step
            side.clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker_side.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Per layer: nothing past one flag's check on a step that loads nothing."""
        side = self._worker_side
        if side.loads_due:
            side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Per layer: nothing past one flag's check on a step that saves nothing."""
        side = self._worker_side
        if side.saves_due:
            side.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and with several KV cache groups the requests whose load failed."""
        side = self._worker_side
        sending, recving = side.get_finished(finished_req_ids)
        if sending is None and recving is None and side.hybrid is None:
            return KVConnectorTransferResults(set(), set(), set())
        failed = side.failed_requests(recving)
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KvdiWorkerMetadata | None:
        return self._worker_side.build_connector_worker_meta()

    def get_kv_connector_kv_cache_events(self) -> KvdiKVEvents | None:
        """vLLM's worker hook: this rank's landed, evicted and dropped blocks (by block key) since the last call."""
        return self._worker_side.fleet.kv_cache_events()

    # ---------------------------------------------------------------- both roles

    def get_kv_connector_stats(self) -> KvdiConnectorStats | None:
        """kvdi's counters since the last call, keyed by the registered connector name; None when none moved.

        vLLM asks every step on both roles: a step where no counter moved builds nothing but the gauges' check; one
        where they moved wakes the stats file's writer thread (``kvdi_stats_dir``:
        :class:`.fleet.stats.StatsFileWriter`), which rewrites the file off the engine's thread.
        """
        delta, extra = self._deltas.deltas()
        counters = self._fleet_counters
        missed = counters.lookup_miss_blocks != counters.reported_misses
        moved = counters.moved_by is not None and counters.moved_by.count != counters.moves_seen  # a breaker moved
        if not (delta or extra or missed or moved) and counters.unmoved_is_empty:
            return None  # the scheduler's idle step: nothing read past the counters' two tuples (and one breaker count)
        entry = counters.entry({**delta, **extra} if delta and extra else delta or extra)
        if not (delta or extra or entry):
            return None
        if self._stats_file is not None and (delta or extra):
            self._stats_file.stale()
        return step_stats(self.half.name, delta, extra, entry)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return FleetConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> Any:
        """vLLM's hook: kvdi's Prometheus series on ``/metrics`` (:mod:`.fleet.prom`)."""
        from kvdi.integrations.vllm.fleet.prom import build_prom_metrics

        return build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _counters(self) -> dict[str, int | float]:
        return {**self._reporter.as_dict(), **self._counts_reporter.as_dict()}

    def shutdown(self) -> None:
        """Shut kvdi's half down (queued saves drained), stop the stats file's writer thread and write the final
        counters (the drained saves counted), close the shared-tier publisher, in that order."""
        if self._closed:
            return
        self._closed = True
        try:
            self.half.shutdown()  # drains queued saves: their counters move here
        finally:
            try:
                if self._stats_file is not None:
                    self._stats_file.close()
                if not self._role_is_worker:
                    self._scheduler_side.fleet.close()  # flushes the shared identity's publisher, if any
            finally:
                SHARED.release(self._engine_id)


class _WrongRole:
    """Stands for the side of the role this connector was not built for: any use raises a RuntimeError."""

    def __init__(self, built: str, called: str) -> None:
        self._message = f"KvdiConnector built for the {built} role was called as a {called}"

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(self._message)


__all__ = ["KvdiConnector"]
