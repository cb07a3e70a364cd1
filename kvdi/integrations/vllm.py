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
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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

from kvdi.allocator import KVCacheSpec
from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorStats,
    KVConnectorMetadata,
    KVRequest,
    ScheduledRequest,
    SchedulerConnector,
    SchedulerOutput,
    WorkerConnector,
)
from kvdi.connectors.framing import HEADER_SIZE
from kvdi.containers import KVTransferContainer, build_kv_container
from kvdi.errors import ConfigError, KVLoadError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")  # vLLM configures only its own logger tree

EXTRA_PREFIX = "kvdi."
STATS_DIR_KEY = "kvdi_stats_dir"
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# --------------------------------------------------------------------------- config


def settings_overrides(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """Nested kvdi overrides from vLLM's extra config: ``{"kvdi.redis.url": u}`` -> ``{"redis": {"url": u}}``.

    A ``"kvdi"`` key holding a mapping is merged the same way; other keys belong to vLLM
    or other connectors and are ignored.
    """
    out: dict[str, Any] = {}
    items: list[tuple[str, Any]] = []
    nested = extra_config.get("kvdi")
    if isinstance(nested, Mapping):
        items.extend(_flatten_mapping(nested))
    items.extend((k[len(EXTRA_PREFIX) :], v) for k, v in extra_config.items() if k.startswith(EXTRA_PREFIX))
    for dotted, value in items:
        parts = [p for p in dotted.split(".") if p]
        if not parts:
            raise ConfigError(f"kv_connector_extra_config key {EXTRA_PREFIX + dotted!r} names no kvdi setting")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"kv_connector_extra_config sets kvdi.{part} both as a value and as a section")
            node = child
        node[parts[-1]] = value
    return out


def _flatten_mapping(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    flat: list[tuple[str, Any]] = []
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and key != "kv_connector_extra_config":
            flat.extend(_flatten_mapping(value, path + "."))
        else:
            flat.append((path, value))
    return flat


def layout_from_vllm(vllm_config: VllmConfig) -> KVCacheSpec:
    """kvdi's KVCacheSpec of vLLM's paged cache: layers, KV heads, head dim, block size, dtype, model id.

    Raises ConfigError for what kvdi's stored format cannot describe (quantized KV cache
    dtypes, tensor or pipeline parallelism).
    """
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "KvdiConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 only "
            f"(got {parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size}): "
            "a stored block holds every layer and head"
        )
    if cache.cache_dtype not in ("auto", None):
        raise ConfigError(
            f"KvdiConnector needs kv_cache_dtype='auto', got {cache.cache_dtype!r}; set --kv-cache-dtype auto"
        )
    dtype = _DTYPES.get(model.dtype) if isinstance(model.dtype, torch.dtype) else None
    if dtype is None:
        raise ConfigError(f"KvdiConnector stores float32, float16 or bfloat16 KV; the model runs in {model.dtype}")
    return KVCacheSpec(
        model_id=f"{model.model}{block_format_tag(vllm_config)}",
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()),
        block_size=int(cache.block_size),
        dtype=dtype,
    )


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


PROCESS_LOCAL_CONNECTORS = frozenset({"cpu_offload"})


def needs_block_index(connector: str, vllm_config: VllmConfig) -> bool:
    """True when ``connector`` keeps blocks in the worker's memory and vLLM runs the scheduler in another process.

    The scheduler half then looks blocks up in a :class:`BlockIndex` that the worker keeps
    current through vLLM's worker-to-scheduler metadata. With
    ``distributed_executor_backend="uni"`` both halves share the real store instead.
    """
    backend = vllm_config.parallel_config.distributed_executor_backend
    return connector in PROCESS_LOCAL_CONNECTORS and backend not in ("uni", "external_launcher")


class BlockIndex:
    """The scheduler process's view of a worker-local store: a :class:`~kvdi.connectors.store.BlockStore` of keys only.

    Holds the keys the worker reported stored, least recently used first, at most
    ``capacity`` (the worker's pool size), and forgets keys the worker reported gone. When
    it is wrong (the pool evicted differently) the load fails, is reported, and vLLM
    recomputes: a lost hit, never wrong output.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):  # the head of a chain ends most recently used, as in the pool
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self._keys:
            n += 1
        for key in reversed(keys[:n]):
            self._keys.move_to_end(key)
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [None] * len(keys)  # the scheduler half never reads payloads

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Any]]]) -> None:
        self.add([key for key, _ in items])

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def close(self) -> None:
        self._keys.clear()


@dataclass
class KvdiWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc,unused-ignore]
    """Worker to scheduler, per step: keys stored and keys found gone (only for a :class:`BlockIndex`)."""

    stored: tuple[bytes, ...] = ()
    dropped: tuple[bytes, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvdiWorkerMetadata:
        if not isinstance(other, KvdiWorkerMetadata):
            return self
        return KvdiWorkerMetadata(self.stored + other.stored, self.dropped + other.dropped)


def kvdi_settings_kwargs(vllm_config: VllmConfig) -> dict[str, Any]:
    """Init kwargs for :func:`kvdi.settings.load_settings`: extra-config overrides plus vLLM's role and engine id.

    vLLM's ``kv_role`` and ``engine_id`` win over the same keys in extra config. kvdi's
    ``kv_load_failure_policy`` is always ``recompute`` (report, never raise): vLLM's own
    policy then recomputes or fails the request.
    """
    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        raise ConfigError("KvdiConnector needs vLLM's kv_transfer_config (--kv-transfer-config)")
    kwargs = settings_overrides(transfer.kv_connector_extra_config or {})
    kwargs["kv_role"] = transfer.kv_role or "kv_both"
    kwargs["engine_id"] = str(transfer.engine_id)
    kwargs["kv_load_failure_policy"] = "recompute"
    return kwargs


# --------------------------------------------------------------------------- layout


def kvdi_layer_view(cache: torch.Tensor, layout: KVCacheSpec, num_blocks: int | None = None) -> torch.Tensor:
    """One layer of vLLM's paged cache as kvdi's worker half addresses it: ``view[block_id]`` is that block.

    - vLLM's CPU backend ``[blocks, heads, block_size, 2 * head_dim]``: returned as is. Each
      block is contiguous and exactly ``layout.layer_block_bytes``, stored verbatim in the
      attention ISA's packing (see :func:`block_format_tag`).
    - ``[blocks, 2, block_size, heads, head_dim]`` (kvdi's order, FlashInfer NHD): as is.
    - ``[2, blocks, block_size, heads, head_dim]`` (FlashAttention NHD): a permuted, non-contiguous
      view in kvdi's order; :class:`LayoutBridge` copies such blocks through a scratch cache.

    Raises ConfigError naming the shape for anything else.
    """
    bs, heads, dim = layout.block_size, layout.num_kv_heads, layout.head_dim
    shape = tuple(cache.shape)
    if cache.dim() == 4 and shape[1:] == (heads, bs, 2 * dim) and cache.is_contiguous():
        return cache
    if cache.dim() == 5 and shape[2:] == (bs, heads, dim):
        if shape[1] == 2 and (num_blocks is None or shape[0] == num_blocks):
            return cache
        if shape[0] == 2:
            return cache.permute(1, 0, 2, 3, 4)
    raise ConfigError(
        f"KvdiConnector does not understand a paged KV tensor of shape {shape} (strides {tuple(cache.stride())}) "
        f"for block_size={bs}, kv_heads={heads}, head_dim={dim}; supported: vLLM's CPU backend and NHD layouts"
    )


def ordered_layers(names: Sequence[str]) -> list[str]:
    """vLLM's attention layer names in forward order (by the layer numbers in the names)."""

    def numbers(name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"(?<![A-Za-z_])\d+", name))

    return sorted(names, key=lambda n: (numbers(n), n))


# --------------------------------------------------------------------------- translation


def kv_request(request: Any) -> KVRequest:
    """kvdi's view of a vLLM ``Request``: id, prompt tokens, and a salt covering cache salt, LoRA and images.

    Requests with prompt embeddings instead of token ids get no tokens (never cached).
    """
    parts: list[str] = []
    salt = getattr(request, "cache_salt", None)
    if salt is not None:
        parts.append(f"salt={salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', lora)}")
    for feature in getattr(request, "mm_features", None) or ():
        parts.append(f"mm={getattr(feature, 'identifier', feature)}")
    tokens = getattr(request, "prompt_token_ids", None) or ()
    return KVRequest(str(request.request_id), tuple(int(t) for t in tokens), "\x1f".join(parts) if parts else None)


@dataclass
class KvdiConnectorMetadata(VllmConnectorMetadata):  # type: ignore[misc,unused-ignore]
    """vLLM's metadata envelope around kvdi's per-step metadata (pickled to the workers)."""

    inner: KVConnectorMetadata | None = None


class RequestTracker:
    """What the scheduler half remembers per running request to rebuild kvdi's full :class:`ScheduledRequest`."""

    def __init__(self) -> None:
        self.requests: dict[str, KVRequest] = {}
        self.blocks: dict[str, list[int]] = {}
        self.step = 0

    def remember(self, request: KVRequest) -> None:
        self.requests[request.request_id] = request

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.blocks.pop(request_id, None)

    def translate(self, output: Any) -> SchedulerOutput:
        """kvdi's SchedulerOutput of one vLLM step; updates block lists (new requests, growth, resumption)."""
        scheduled: list[ScheduledRequest] = []
        for new in output.scheduled_new_reqs:
            req_id = str(new.req_id)
            request = self.requests.get(req_id)
            if request is None:
                request = KVRequest(req_id, tuple(new.prompt_token_ids or ()))
                self.requests[req_id] = request
            self.blocks[req_id] = list(new.block_ids[0]) if new.block_ids else []
            scheduled.append(self._scheduled(request, new.num_computed_tokens, output))
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self.requests.get(req_id)
            if request is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.blocks[req_id] = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                self.blocks.setdefault(req_id, []).extend(new_blocks[0])
            scheduled.append(self._scheduled(request, cached.num_computed_tokens[i], output))
        finished = frozenset(str(r) for r in output.finished_req_ids)
        for req_id in finished:
            self.forget(req_id)
        self.step += 1
        return SchedulerOutput(self.step, tuple(scheduled), finished)

    def _scheduled(self, request: KVRequest, num_computed: int, output: Any) -> ScheduledRequest:
        rid = request.request_id
        return ScheduledRequest(
            request, tuple(self.blocks.get(rid, ())), int(num_computed), int(output.num_scheduled_tokens.get(rid, 0))
        )


class LayoutBridge:
    """Gives kvdi's worker half caches whose blocks are contiguous, copying through scratch only when needed.

    kvdi's store halves read and write each layer's block as one contiguous run of bytes.
    When every view from :func:`kvdi_layer_view` has contiguous blocks (``direct``: vLLM's
    CPU backend, NHD layouts with blocks outermost) the worker half gets vLLM's tensors and
    nothing is copied. Otherwise the worker half is given a small contiguous scratch cache in
    kvdi's order: each step's :class:`BlockTransferMetadata` is rewritten from vLLM block ids
    to scratch slots, blocks to save are gathered into scratch before the save, and loaded
    blocks are scattered into vLLM's cache after the load.
    """

    def __init__(self, views: Mapping[str, torch.Tensor], worker: WorkerConnector) -> None:
        self.views = dict(views)
        self.worker = worker
        self.direct = all(v.is_contiguous() for v in self.views.values())
        self.scratch: dict[str, torch.Tensor] = {}
        self._loads: list[tuple[int, int]] = []  # (vllm block id, scratch slot)
        self._saves: list[tuple[int, int]] = []
        self._slot_to_block: dict[int, int] = {}
        self._errors: set[int] = set()
        worker.register_kv_caches(self.views if self.direct else self._ensure_scratch(1))

    def _ensure_scratch(self, slots: int) -> dict[str, torch.Tensor]:
        have = next(iter(self.scratch.values())).shape[0] if self.scratch else 0
        if slots > have:
            size = max(slots, 2 * have)
            self.scratch = {
                name: torch.empty((size, *view.shape[1:]), dtype=view.dtype, device=view.device)
                for name, view in self.views.items()
            }
            if have:
                self.worker.register_kv_caches(self.scratch)
        return self.scratch

    def bind(self, metadata: KVConnectorMetadata) -> KVConnectorMetadata:
        """The metadata to hand kvdi's worker half for this step (block ids mapped to scratch slots)."""
        self._loads, self._saves, self._slot_to_block = [], [], {}
        if self.direct or not isinstance(metadata, BlockTransferMetadata):
            return metadata
        next_slot = 0

        def remap(transfers: Sequence[BlockTransfer], pairs: list[tuple[int, int]]) -> tuple[BlockTransfer, ...]:
            nonlocal next_slot
            out = []
            for t in transfers:
                slots = tuple(range(next_slot, next_slot + len(t.block_ids)))
                next_slot += len(slots)
                pairs.extend(zip(t.block_ids, slots, strict=True))
                out.append(BlockTransfer(t.request_id, slots, t.block_keys))
            return tuple(out)

        loads, saves = remap(metadata.loads, self._loads), remap(metadata.saves, self._saves)
        self._slot_to_block = dict((slot, block) for block, slot in self._loads)
        if next_slot:
            self._ensure_scratch(next_slot)
        return BlockTransferMetadata(loads, saves)

    def after_load(self) -> None:
        """Scatter the blocks kvdi loaded into scratch into vLLM's cache; remember failed vLLM block ids."""
        failed_slots = self.worker.get_block_ids_with_load_errors()
        if self.direct:
            self._errors |= failed_slots
            return
        self._errors |= {self._slot_to_block.get(s, s) for s in failed_slots}
        good = [(b, s) for b, s in self._loads if s not in failed_slots and b not in self._errors]
        if not good:
            return
        blocks = torch.tensor([b for b, _ in good], dtype=torch.long)
        slots = torch.tensor([s for _, s in good], dtype=torch.long)
        for name, view in self.views.items():
            src = self.scratch[name]
            view[blocks.to(view.device)] = src[slots.to(src.device)]

    def before_save(self) -> None:
        """Gather the blocks to save from vLLM's cache into scratch (kvdi's byte order)."""
        if self.direct or not self._saves:
            return
        blocks = torch.tensor([b for b, _ in self._saves], dtype=torch.long)
        slots = torch.tensor([s for _, s in self._saves], dtype=torch.long)
        for name, view in self.views.items():
            dst = self.scratch[name]
            dst[slots.to(dst.device)] = view[blocks.to(view.device)]

    def take_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        errors, self._errors = self._errors, set()
        return errors


# --------------------------------------------------------------------------- stats


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


def stats_delta(now: ConnectorStats, before: dict[str, int | float]) -> dict[str, int | float]:
    """Counters of ``now`` minus the snapshot ``before`` (zeros kept out)."""
    return {k: v - before.get(k, 0) for k, v in now.as_dict().items() if v - before.get(k, 0)}


def write_stats_file(directory: str, engine_id: str, role: str, name: str, stats: ConnectorStats) -> None:
    """Cumulative counters as ``<dir>/<engine_id>-<role>-<pid>.json``, published atomically."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    target = path / f"{engine_id}-{role}-{os.getpid()}.json"
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps({"connector": name, "role": role, "engine_id": engine_id, **stats.as_dict()}))
    os.replace(tmp, target)


# --------------------------------------------------------------------------- shared containers


class _SharedContainers:
    """One kvdi container per engine id within a process, so co-located halves share one backend.

    Module-level on purpose: vLLM constructs each role separately and gives the two
    objects no way to reach each other.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[KVTransferContainer, int]] = {}

    def acquire(self, engine_id: str, settings_kwargs: dict[str, Any], layout: KVCacheSpec) -> KVTransferContainer:
        with self._lock:
            entry = self._entries.get(engine_id)
            if entry is None:
                container = build_kv_container(**settings_kwargs)
                container.layout.override(providers.Object(layout))
                entry = (container, 0)
            self._entries[engine_id] = (entry[0], entry[1] + 1)
            return entry[0]

    def release(self, engine_id: str) -> None:
        with self._lock:
            entry = self._entries.get(engine_id)
            if entry is None:
                return
            container, users = entry
            if users > 1:
                self._entries[engine_id] = (container, users - 1)
                return
            del self._entries[engine_id]
        container.shutdown_resources()


_SHARED = _SharedContainers()


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
