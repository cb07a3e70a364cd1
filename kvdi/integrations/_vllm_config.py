"""The parts of :mod:`kvdi.integrations.vllm` that need no vLLM: settings, layout, shared containers, stats.

- :func:`settings_overrides` / :func:`kvdi_settings_kwargs`: kvdi settings from the
  ``kvdi.``-prefixed keys of vLLM's ``kv_connector_extra_config`` plus vLLM's role and engine id;
- :func:`kv_cache_spec`: kvdi's :class:`KVCacheSpec` of vLLM's model and cache config (the
  vLLM-specific block format tag is passed in by the adapter);
- :func:`needs_block_index`: whether the scheduler half needs a :class:`BlockIndex`;
- :class:`_SharedContainers`: one kvdi container per engine id per process;
- :func:`stats_delta` / :func:`write_stats_file`: counters for vLLM's stats and the stats directory.

vLLM objects arrive here as plain attribute bags (typed ``Any``); this module never imports vLLM.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from dependency_injector import providers

from kvdi.connectors.base import ConnectorStats
from kvdi.containers import KVTransferContainer, build_kv_container
from kvdi.errors import ConfigError
from kvdi.layout import KVCacheSpec
from kvdi.settings.paths import flatten

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
        items.extend(flatten(nested))
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


def kv_cache_spec(vllm_config: Any, format_tag: Callable[[Any], str]) -> KVCacheSpec:
    """kvdi's KVCacheSpec of vLLM's paged cache: layers, KV heads, head dim, block size, dtype, model id.

    ``vllm_config`` is vLLM's ``VllmConfig``; ``format_tag(vllm_config)`` is appended to the
    model id (see :func:`kvdi.integrations.vllm.block_format_tag`). Raises ConfigError for what
    kvdi's stored format cannot describe (quantized KV cache dtypes, tensor or pipeline parallelism).
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
        model_id=f"{model.model}{format_tag(vllm_config)}",
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()),
        block_size=int(cache.block_size),
        dtype=dtype,
    )


PROCESS_LOCAL_CONNECTORS = frozenset({"cpu_offload"})


def needs_block_index(connector: str, vllm_config: Any) -> bool:
    """True when ``connector`` keeps blocks in the worker's memory and vLLM runs the scheduler in another process.

    The scheduler half then looks blocks up in a :class:`BlockIndex` that the worker keeps
    current through vLLM's worker-to-scheduler metadata. With
    ``distributed_executor_backend="uni"`` both halves share the real store instead.
    """
    backend = vllm_config.parallel_config.distributed_executor_backend
    return connector in PROCESS_LOCAL_CONNECTORS and backend not in ("uni", "external_launcher")


def kvdi_settings_kwargs(vllm_config: Any) -> dict[str, Any]:
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
