"""Run kvdi's connectors inside vLLM (0.32, V1 engine) through ``kv_connector_module_path``.

Select it with::

    KVTransferConfig(
        kv_connector="KvdiConnector",
        kv_connector_module_path="kvdi.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"kvdi.kv_connector": "shared_storage",
                                   "kvdi.shared_storage.path": "/tmp/kv"},
    )

:class:`KvdiConnector` is the one class vLLM instantiates, once per role
(``cls(vllm_config, role, kv_cache_config)``). On construction it builds kvdi's settings
from the ``kvdi.``-prefixed keys of ``kv_connector_extra_config`` layered over ``KVDI_*``
env, takes ``kv_role`` and ``engine_id`` from vLLM, derives the :class:`KVCacheSpec` from
vLLM's model and cache config, and builds kvdi's scheduler or worker half from a
:func:`~kvdi.containers.build_kv_container` container. Every vLLM call is translated to
kvdi's contract (:mod:`kvdi.connectors.base`):

- vLLM ``Request`` -> :class:`KVRequest` (prompt tokens; cache salt, LoRA name and
  multimodal hashes folded into the salt so they isolate KV);
- vLLM ``SchedulerOutput`` -> kvdi :class:`SchedulerOutput` (the adapter tracks each
  request's full block list, since vLLM sends only new blocks of running requests);
- vLLM's per-layer paged KV tensors -> tensors indexed by block id whose blocks are
  contiguous, as kvdi's worker half needs (:func:`kvdi_layer_view`, :class:`LayoutBridge`).
  On vLLM's CPU backend that is vLLM's own tensor (zero-copy); the CPU attention packs a
  block its own way, so the packing is named in the layout fingerprint
  (:func:`block_format_tag`).

Failed loads are reported through ``get_block_ids_with_load_errors`` and vLLM's own
``kv_load_failure_policy`` decides between recomputing and failing the request (kvdi's
half always reports instead of raising). Counters go out through
``get_kv_connector_stats`` (deltas per step, keyed by the registered connector name) and,
when ``kv_connector_extra_config["kvdi_stats_dir"]`` is set, as cumulative JSON files.

Both halves of one engine share one container (so one backend) when vLLM builds them in
the same process, which it does with ``distributed_executor_backend="uni"`` (on CPU also
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Otherwise they live in different processes: shared
backends (a directory, a Redis server) need nothing more, and for ``cpu_offload``, whose
pool lives in the worker's memory, the scheduler half looks blocks up in a
:class:`BlockIndex` the worker keeps current through vLLM's worker-to-scheduler metadata.

The pieces that need no vLLM live in :mod:`kvdi.integrations._vllm_config` (settings, layout
checks, shared containers, stats files) and :mod:`kvdi.integrations._vllm_blocks` (requests,
block tracking, KV tensor layouts); they are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from dependency_injector import providers

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as VllmConnectorMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorRole as VllmRole,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.logger import init_logger
except ImportError as exc:  # only vLLM loads this module; say what to install if someone else does
    raise ImportError(f"kvdi.integrations.vllm needs vLLM ({exc}); install it with: pip install 'kvdi[vllm]'") from exc

from kvdi.connectors.base import (
    BlockTransferMetadata,
    KVConnectorMetadata,
    SchedulerConnector,
    WorkerConnector,
)
from kvdi.connectors.framing import HEADER_SIZE
from kvdi.errors import ConfigError, KVLoadError
from kvdi.integrations._vllm_blocks import BlockIndex as BlockIndex
from kvdi.integrations._vllm_blocks import LayoutBridge as LayoutBridge
from kvdi.integrations._vllm_blocks import RequestTracker as RequestTracker
from kvdi.integrations._vllm_blocks import kv_request as kv_request
from kvdi.integrations._vllm_blocks import kvdi_layer_view as kvdi_layer_view
from kvdi.integrations._vllm_blocks import ordered_layers as ordered_layers
from kvdi.integrations._vllm_config import _SHARED, kv_cache_spec
from kvdi.integrations._vllm_config import EXTRA_PREFIX as EXTRA_PREFIX
from kvdi.integrations._vllm_config import PROCESS_LOCAL_CONNECTORS as PROCESS_LOCAL_CONNECTORS
from kvdi.integrations._vllm_config import STATS_DIR_KEY as STATS_DIR_KEY
from kvdi.integrations._vllm_config import kvdi_settings_kwargs as kvdi_settings_kwargs
from kvdi.integrations._vllm_config import needs_block_index as needs_block_index
from kvdi.integrations._vllm_config import settings_overrides as settings_overrides
from kvdi.integrations._vllm_config import stats_delta as stats_delta
from kvdi.integrations._vllm_config import write_stats_file as write_stats_file
from kvdi.layout import KVCacheSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")  # vLLM configures only its own logger tree


# --------------------------------------------------------------------------- layout


def layout_from_vllm(vllm_config: VllmConfig) -> KVCacheSpec:
    """kvdi's KVCacheSpec of vLLM's paged cache: layers, KV heads, head dim, block size, dtype, model id.

    Raises ConfigError for what kvdi's stored format cannot describe (quantized KV cache
    dtypes, tensor or pipeline parallelism).
    """
    return kv_cache_spec(vllm_config, block_format_tag)


def block_format_tag(vllm_config: VllmConfig) -> str:
    """Suffix of the layout's model id naming how a stored block's bytes are ordered.

    On vLLM's CPU backend kvdi stores each block verbatim (zero-copy), and the order of
    bytes inside a block depends on the CPU attention ISA (for ``vec`` the K tile is
    ``[head_dim, block_size]``, the V tile ``[block_size, head_dim]``). The ISA goes into
    the fingerprint so blocks are only ever loaded by engines that pack them the same way.
    Elsewhere blocks are stored in kvdi's order and the tag is empty.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model = vllm_config.model_config
        isa = _get_attn_isa(model.dtype, vllm_config.cache_config.block_size, model.get_head_size())  # type: ignore[arg-type,unused-ignore]
    except Exception:  # private helper of vLLM; a coarser tag still never mixes CPU and kvdi order
        isa = "unknown"
    return f"@vllm-cpu-{isa}"


# --------------------------------------------------------------------------- vLLM envelopes and stats


@dataclass
class KvdiWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc,unused-ignore]
    """Worker to scheduler, per step: keys stored and keys found gone (only for a :class:`BlockIndex`)."""

    stored: tuple[bytes, ...] = ()
    dropped: tuple[bytes, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvdiWorkerMetadata:
        if not isinstance(other, KvdiWorkerMetadata):
            return self
        return KvdiWorkerMetadata(self.stored + other.stored, self.dropped + other.dropped)


@dataclass
class KvdiConnectorMetadata(VllmConnectorMetadata):  # type: ignore[misc,unused-ignore]
    """vLLM's metadata envelope around kvdi's per-step metadata (pickled to the workers)."""

    inner: KVConnectorMetadata | None = None


@dataclass
class KvdiConnectorStats(KVConnectorStats):  # type: ignore[misc,unused-ignore]
    """kvdi counters in vLLM's stats pipeline: ``data = {connector_name: {counter: value}}``."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvdiConnectorStats:
        merged: dict[str, dict[str, float]] = {name: dict(c) for name, c in self.data.items()}
        for name, counters in (other.data or {}).items():
            into = merged.setdefault(name, {})
            for key, value in counters.items():
                into[key] = into.get(key, 0) + value
        return KvdiConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {f"{name}.{key}": v for name, counters in self.data.items() for key, v in counters.items() if v}

    def is_empty(self) -> bool:
        return not any(value for counters in self.data.values() for value in counters.values())


# --------------------------------------------------------------------------- the connector


class KvdiConnector(KVConnectorBase_V1):  # type: ignore[misc,unused-ignore]
    """vLLM's KVConnectorBase_V1 over kvdi's connector halves (one role per instance)."""

    def __init__(self, vllm_config: VllmConfig, role: VllmRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.layout = layout_from_vllm(vllm_config)
        self._engine_id = str(self._kv_transfer_config.engine_id)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._stats_dir: str | None = extra.get(STATS_DIR_KEY)
        container = _SHARED.acquire(self._engine_id, kvdi_settings_kwargs(vllm_config), self.layout)
        self._index_mode = needs_block_index(container.connector().spec.name, vllm_config)
        self._index: BlockIndex | None = None
        self._scheduler: SchedulerConnector | None = None
        self._worker: WorkerConnector | None = None
        self.half: SchedulerConnector | WorkerConnector
        try:
            if role == VllmRole.SCHEDULER:
                if self._index_mode:
                    pool_bytes = container.settings().cpu_offload.max_bytes
                    self._index = BlockIndex(pool_bytes // (HEADER_SIZE + self.layout.block_bytes))
                    container.backend.override(providers.Object(self._index))
                self._scheduler = self.half = cast(SchedulerConnector, container.scheduler_connector())
            else:
                self._worker = self.half = cast(WorkerConnector, container.worker_connector())
        except BaseException:
            _SHARED.release(self._engine_id)
            raise
        self._step_meta: BlockTransferMetadata | None = None
        self._stored_keys: list[bytes] = []
        self._dropped_keys: list[bytes] = []
        self._tracker = RequestTracker()
        self._layer_names: dict[str, str] = {}
        self._bridge: LayoutBridge | None = None
        self._num_blocks: int | None = getattr(kv_cache_config, "num_blocks", None)
        self._reported: dict[str, int | float] = {}
        self._written: dict[str, int | float] = {}
        self._closed = False
        logger.info("kvdi %r %s half for engine %s: %s", self.half.name, role.name, self._engine_id, self.layout)

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
        """How many tokens kvdi can load beyond ``num_computed_tokens`` (0 for a producer-only engine)."""
        req = kv_request(request)
        self._tracker.remember(req)
        n, load_async = self.scheduler_half.get_num_new_matched_tokens(req, num_computed_tokens)
        return n, bool(load_async and n)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Forward the request's blocks (first KV cache group) and accepted token count to kvdi."""
        req = kv_request(request)
        self._tracker.remember(req)
        ids = blocks.get_block_ids()[0] if blocks is not None else []
        self.scheduler_half.update_state_after_alloc(req, list(ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvdiConnectorMetadata:
        """kvdi's metadata for this step, in vLLM's envelope."""
        output = self._tracker.translate(scheduler_output)
        return KvdiConnectorMetadata(inner=self.scheduler_half.build_connector_meta(output))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Tell kvdi the request ended; returns kvdi's (delay_free, kv_transfer_params)."""
        req = self._tracker.requests.get(str(request.request_id)) or kv_request(request)
        try:
            return self.scheduler_half.request_finished(req, list(block_ids))
        finally:
            self._tracker.forget(req.request_id)

    def update_connector_output(self, connector_output: Any) -> None:
        """Apply the worker's report of stored and vanished keys to the scheduler's :class:`BlockIndex`."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._index is not None and isinstance(meta, KvdiWorkerMetadata):
            self._index.add(meta.stored)
            for key in meta.dropped:
                self._index.discard(key)

    # ---------------------------------------------------------------- worker role

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Map vLLM's layers to kvdi's ``layers.<i>`` and hand kvdi's worker half caches in kvdi's layout."""
        names = ordered_layers(list(kv_caches))
        expected = self.layout.layer_names
        if len(names) != len(expected):
            raise ConfigError(f"vLLM registered {len(names)} KV cache layers, the model config says {len(expected)}")
        self._layer_names = dict(zip(names, expected, strict=True))
        views = {
            kvdi: kvdi_layer_view(kv_caches[name], self.layout, self._num_blocks)
            for name, kvdi in self._layer_names.items()
        }
        self._bridge = LayoutBridge(views, self.worker_half)
        first = kv_caches[names[0]]
        logger.info(
            "kvdi: vLLM KV layer %s has shape %s; kvdi block view %s (%s)",
            names[0],
            tuple(first.shape),
            tuple(views[expected[0]].shape),
            "zero-copy" if self._bridge.direct else "bridged through a kvdi-layout scratch cache",
        )

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is None or not isinstance(connector_metadata, KvdiConnectorMetadata):
            return
        inner = connector_metadata.inner
        self._step_meta = inner if isinstance(inner, BlockTransferMetadata) else None
        if inner is not None:
            self._worker.bind_connector_metadata(self._bridge.bind(inner) if self._bridge is not None else inner)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Run kvdi's loads for this step into vLLM's paged cache (synchronously)."""
        if self._worker is None or self._worker.metadata is None:
            return
        try:
            self._worker.start_load_kv()
        except KVLoadError as exc:  # kvdi is set to report, but never take the engine down
            logger.warning("kvdi load failed: %s", exc)
        if self._bridge is not None:
            self._bridge.after_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None and self._worker.metadata is not None:
            self._worker.wait_for_layer_load(self._layer_names.get(layer_name, layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is None or self._worker.metadata is None:
            return
        kvdi_name = self._layer_names.get(layer_name)
        if kvdi_name is not None:
            self._worker.save_kv_layer(kvdi_name, kvdi_layer_view(kv_layer, self.layout, self._num_blocks))

    def wait_for_save(self) -> None:
        if self._worker is None or self._worker.metadata is None:
            return
        if self._bridge is not None:
            self._bridge.before_save()
        failures = self._worker.stats.save_failures
        self._worker.wait_for_save()
        if self._index_mode and self._step_meta is not None and self._worker.stats.save_failures == failures:
            self._stored_keys.extend(k for t in self._step_meta.saves for k in t.block_keys)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose kvdi load failed (missing, corrupt, foreign); vLLM recomputes or fails them."""
        if self._bridge is not None:
            errors = self._bridge.take_errors()
        else:
            errors = self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()
        if errors and self._index_mode and self._step_meta is not None:
            # A chain stops loading at its first bad block: the rest of it is gone for the scheduler too.
            self._dropped_keys.extend(
                k for t in self._step_meta.loads for b, k in zip(t.block_ids, t.block_keys, strict=True) if b in errors
            )
        return errors

    def build_connector_worker_meta(self) -> KvdiWorkerMetadata | None:
        """Keys stored or found gone this step, for the scheduler's :class:`BlockIndex` (None otherwise)."""
        if not (self._stored_keys or self._dropped_keys):
            return None
        meta = KvdiWorkerMetadata(tuple(self._stored_keys), tuple(self._dropped_keys))
        self._stored_keys, self._dropped_keys = [], []
        return meta

    # ---------------------------------------------------------------- both roles

    def get_kv_connector_stats(self) -> KvdiConnectorStats | None:
        """kvdi's counters since the last call, keyed by the registered connector name."""
        stats = self.half.stats
        now = stats.as_dict()
        if self._stats_dir and now != self._written:
            write_stats_file(self._stats_dir, self._engine_id, self.role.name.lower(), self.half.name, stats)
            self._written = now
        delta = stats_delta(stats, self._reported)
        self._reported = now
        return KvdiConnectorStats(data={self.half.name: delta}) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvdiConnectorStats:
        return KvdiConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        """Write final counters, shut kvdi's half down, release the shared container."""
        if self._closed:
            return
        self._closed = True
        if self._stats_dir:
            write_stats_file(self._stats_dir, self._engine_id, self.role.name.lower(), self.half.name, self.half.stats)
        try:
            self.half.shutdown()
        finally:
            _SHARED.release(self._engine_id)


__all__ = [
    "KvdiConnector",
    "KvdiConnectorMetadata",
    "KvdiConnectorStats",
    "kv_request",
    "kvdi_layer_view",
    "kvdi_settings_kwargs",
    "layout_from_vllm",
    "ordered_layers",
    "settings_overrides",
]
