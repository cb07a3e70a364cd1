"""kvdi settings from vLLM's config: ``kvdi.``-prefixed extra-config keys, vLLM's role and engine id.

- :func:`settings_overrides` / :func:`kvdi_settings_kwargs`: kvdi settings from the
  ``kvdi.``-prefixed keys of vLLM's ``kv_connector_extra_config`` plus vLLM's role and engine id;
- :func:`needs_block_index`: whether the scheduler half needs a :class:`BlockIndex`.

vLLM's config arrives as an attribute bag (typed ``Any``); this module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdi.errors import ConfigError
from kvdi.integrations.vllm.weights import weights_identity
from kvdi.registry import ConnectorSpec
from kvdi.settings import load_settings
from kvdi.settings.vllm_compat import extra_config_overrides

STATS_DIR_KEY = "kvdi_stats_dir"

# --------------------------------------------------------------------------- config


def settings_overrides(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """Nested kvdi overrides from vLLM's extra config: ``{"kvdi.redis.url": u}`` -> ``{"redis": {"url": u}}``
    (:func:`kvdi.settings.vllm_compat.extra_config_overrides`, the one parser of it)."""
    return extra_config_overrides(extra_config)


def needs_block_index(spec: ConnectorSpec, vllm_config: Any) -> bool:
    """True when the connector keeps blocks in the worker's memory and vLLM runs the scheduler in another process.

    "In the worker's memory" is the connector's own declaration
    (:attr:`~kvdi.registry.ConnectorSpec.process_local`).

    The scheduler half then looks blocks up in a :class:`BlockIndex` that the worker keeps
    current through vLLM's worker-to-scheduler metadata. With
    ``distributed_executor_backend="uni"`` both halves share the real store instead.
    """
    return spec.process_local and worker_elsewhere(vllm_config)


def worker_elsewhere(vllm_config: Any) -> bool:
    """True when vLLM builds the worker role in another process than the scheduler role (not ``uni``)."""
    return vllm_config.parallel_config.distributed_executor_backend not in ("uni", "external_launcher")


def model_identity(vllm_config: Any) -> str:
    """The layout's model id: ``kvdi.model_revision`` when set, else the weights' identity (:mod:`.weights`)."""
    override = None
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        override = load_settings(**kvdi_settings_kwargs(vllm_config)).model_revision
    model = vllm_config.model_config
    return weights_identity(str(model.model), getattr(model, "revision", None), override)


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
