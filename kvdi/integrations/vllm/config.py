"""kvdi settings from vLLM's config: ``kvdi.``-prefixed extra-config keys, vLLM's role and engine id.

- :func:`settings_overrides` / :func:`kvdi_settings_kwargs`: kvdi settings from the
  ``kvdi.``-prefixed keys of vLLM's ``kv_connector_extra_config`` plus vLLM's role and engine id;
- :func:`needs_block_index`: whether the scheduler half needs a :class:`BlockIndex`;
- :func:`events_identity` / :func:`shared_topic`: the shared identity kvdi's events for shared tiers are
  published under (``kvdi_events_identity``, see docs/events.md).

vLLM's config arrives as an attribute bag (typed ``Any``); this module never imports vLLM.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from kvdi.errors import ConfigError, KvdiError
from kvdi.integrations.vllm.weights import weights_identity
from kvdi.registry import ConnectorSpec
from kvdi.settings import load_settings
from kvdi.settings.loading import as_written
from kvdi.settings.vllm_compat import (
    EVENTS_IDENTITY_KEY,
    STATS_DIR_KEY,
    extra_config_overrides,
    kvdi_child,
    transfer_key,
)

POLICY = "kv_load_failure_policy"
_IDENTITY = re.compile(r"(pool|node):[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
IDENTITY_OFF = ("", "off")
logger = logging.getLogger(f"vllm.{__name__}")  # vLLM formats only its own logger tree

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
    kwargs = written_kwargs(vllm_config)
    kwargs[POLICY] = "recompute"
    return kwargs


def written_kwargs(vllm_config: Any) -> dict[str, Any]:
    """The settings the user wrote in vLLM's transfer config (extra-config keys, ``kv_role``, ``engine_id``)."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        raise ConfigError("KvdiConnector needs vLLM's kv_transfer_config (--kv-transfer-config)")
    kwargs = settings_overrides(transfer.kv_connector_extra_config or {})
    kwargs["kv_role"] = transfer.kv_role or "kv_both"
    kwargs["engine_id"] = str(transfer.engine_id)
    return kwargs


def kvdi_load_failure_policy(vllm_config: Any) -> str:
    """kvdi's ``kv_load_failure_policy`` as the user set it (``kvdi.kv_load_failure_policy``, ``KVDI_*`` env, the
    settings file; default ``recompute``): what happens to a request whose stored KV turns out bad or missing."""
    return str(load_settings(**written_kwargs(vllm_config)).kv_load_failure_policy)


def adopt_load_failure_policy(vllm_config: Any) -> str:
    """Make vLLM's ``kv_load_failure_policy`` kvdi's (:func:`kvdi_load_failure_policy`); the policy in force.

    kvdi's policy is what happens: vLLM's field defaults to ``fail`` (a bad stored object would
    fail the request, an HTTP 500 under ``vllm serve``) and an explicit ``fail`` cannot be told
    from that default, so kvdi writes its own policy there, logging a line when it changes it.
    vLLM reads the field after it built the scheduler's connector. Under vLLM's MultiConnector
    the kvdi child sees a copy: the parent's field decides (``kvdi check --vllm-config`` says so).
    """
    transfer = vllm_config.kv_transfer_config
    policy = kvdi_load_failure_policy(vllm_config)
    if transfer.kv_load_failure_policy != policy:
        logger.info(
            "kvdi: vLLM's kv_load_failure_policy %r set to %r (kvdi.kv_load_failure_policy): a bad or missing stored "
            "block %s",
            transfer.kv_load_failure_policy,
            policy,
            "is a miss, the engine recomputes it" if policy == "recompute" else "fails its request",
        )
        transfer.kv_load_failure_policy = policy
    return policy


def renamed_for_transfer_config(exc: KvdiError, vllm_config: Any) -> KvdiError:
    """``exc`` with its message naming the ``--kv-transfer-config`` key of each setting read from there (not the
    ``KVDI_*`` variable or keyword argument kvdi builds it as); validation and backend errors alike."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None or len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return exc
    try:
        overrides = written_kwargs(vllm_config)
    except KvdiError:  # the extra config itself is what is wrong: the message already names its key
        return exc
    exc.args = (as_written(exc.args[0], overrides, transfer_key("--kv-transfer-config")),)
    return exc


def events_identity(vllm_config: Any) -> str | None:
    """The shared identity of kvdi's events for shared tiers (``kvdi_events_identity``: ``pool:<name>`` or
    ``node:<name>``), None when off (the default: every event under this engine's own identity, as before)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = (getattr(transfer, "kv_connector_extra_config", None) or {}) if transfer is not None else {}
    return parse_events_identity(extra.get(EVENTS_IDENTITY_KEY))


def parse_events_identity(value: object) -> str | None:
    """``value`` of ``kvdi_events_identity`` checked: the identity, or None for off (unset, ``""``, ``"off"``)."""
    if value is None or value in IDENTITY_OFF:
        return None
    if not isinstance(value, str) or not _IDENTITY.fullmatch(value):
        raise ConfigError(
            f"kv_connector_extra_config key {EVENTS_IDENTITY_KEY!r} is {str(value)[:80]!r}: allowed 'pool:<name>' or "
            "'node:<name>' (<name>: letters, digits, '.', '_', '-'), or 'off' (the default)"
        )
    return value


def shared_topic(vllm_topic: str, identity: str, model: str) -> str:
    """The topic of kvdi's shared-tier events: vLLM's ``kv@<pod>@<model>`` (llm-d's topic) with ``identity`` in
    the pod's place, or ``kv@<identity>@<model>`` when vLLM's topic has another shape (vLLM's default is ``""``)."""
    parts = vllm_topic.split("@")
    if len(parts) == 3 and parts[2]:
        return f"{parts[0]}@{identity}@{parts[2]}"
    return f"kv@{identity}@{model}"


def load_failure_outcome(raw: str) -> str:
    """What a ``vllm serve`` given ``--kv-transfer-config raw`` does with a bad or missing stored object: one line
    for ``kvdi check --vllm-config`` (the JSON was validated before)."""
    data = json.loads(raw)
    _place, child = kvdi_child(data, "--vllm-config")
    policy = load_settings(
        **extra_config_overrides(child.get("kv_connector_extra_config") or {})
    ).kv_load_failure_policy
    outcome = {"recompute": "a miss, the engine recomputes it", "fail": "vLLM FAILS the request (HTTP 500)"}
    if data.get("kv_connector") != "MultiConnector":
        return f"on a bad or missing stored object: {outcome[str(policy)]} (kvdi.{POLICY}={policy}; kvdi sets vLLM's)"
    parent = data.get(POLICY, "fail")
    line = f"on a bad or missing stored object: {outcome.get(parent, parent)} (MultiConnector's {POLICY}={parent}"
    if parent == policy:
        return line + ")"
    return line + (
        f'{", vLLM default" if POLICY not in data else ""}; kvdi\'s is {policy}: set "{POLICY}": "{policy}" beside '
        "the MultiConnector's kv_connector, where vLLM reads it)"
    )


__all__ = [
    "STATS_DIR_KEY",
    "EVENTS_IDENTITY_KEY",
    "adopt_load_failure_policy",
    "events_identity",
    "kvdi_load_failure_policy",
    "kvdi_settings_kwargs",
    "load_failure_outcome",
    "model_identity",
    "needs_block_index",
    "parse_events_identity",
    "renamed_for_transfer_config",
    "settings_overrides",
    "shared_topic",
    "worker_elsewhere",
    "written_kwargs",
]
