"""vLLM-compatible configuration source.

Reads ``KVDI_KV_TRANSFER_CONFIG`` (vLLM's ``--kv-transfer-config`` JSON) and ``VLLM_USE_V1``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource

from kvdi.errors import ConfigError, did_you_mean
from kvdi.settings.paths import MAX_NESTING, nesting_depth

TRANSFER_CONFIG_ENV = "KVDI_KV_TRANSFER_CONFIG"
VLLM_USE_V1_ENV = "VLLM_USE_V1"

# vLLM KVTransferConfig keys accepted in KVDI_KV_TRANSFER_CONFIG, and where each lands.
VLLM_KEYS: dict[str, tuple[str, ...]] = {
    "kv_connector": ("kv_connector",),
    "kv_role": ("kv_role",),
    "kv_connector_module_path": ("kv_connector_module_path",),
    "kv_connector_extra_config": ("kv_connector_extra_config",),
    "engine_id": ("engine_id",),
    "kv_load_failure_policy": ("kv_load_failure_policy",),
    "kv_ip": ("p2p", "kv_ip"),
    "kv_port": ("p2p", "kv_port"),
    "kv_rank": ("p2p", "kv_rank"),
    "kv_parallel_size": ("p2p", "kv_parallel_size"),
}


class VllmCompatSource(PydanticBaseSettingsSource):
    """Reads vLLM-style config: ``KVDI_KV_TRANSFER_CONFIG`` JSON and ``VLLM_USE_V1``."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        raw = os.environ.get(TRANSFER_CONFIG_ENV)
        if raw:
            out.update(parse_transfer_config(raw))
        vllm_v1 = os.environ.get(VLLM_USE_V1_ENV)
        if vllm_v1 is not None and vllm_v1.strip() != "":
            out["use_v1"] = vllm_v1
        return out


def parse_transfer_config(raw: str) -> dict[str, Any]:
    """Map vLLM's ``--kv-transfer-config`` JSON onto kvdi's fields; raise ConfigError if malformed or too deep."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{TRANSFER_CONFIG_ENV} is not valid JSON ({exc.msg} at char {exc.pos}); expected a JSON object"
        ) from None
    except RecursionError:
        raise ConfigError(f"{TRANSFER_CONFIG_ENV} is nested deeper than {MAX_NESTING} levels") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{TRANSFER_CONFIG_ENV} must be a JSON object, got {type(data).__name__}")
    if nesting_depth(data) > MAX_NESTING:
        raise ConfigError(f"{TRANSFER_CONFIG_ENV} is nested deeper than {MAX_NESTING} levels")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in VLLM_KEYS:
            raise ConfigError(
                f"{TRANSFER_CONFIG_ENV} has unknown key {key!r}; allowed: {', '.join(VLLM_KEYS)}"
                f"{did_you_mean(key, VLLM_KEYS)}"
            )
        *parents, leaf = VLLM_KEYS[key]
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return out


__all__ = ["TRANSFER_CONFIG_ENV", "VLLM_KEYS", "VLLM_USE_V1_ENV", "VllmCompatSource", "parse_transfer_config"]
