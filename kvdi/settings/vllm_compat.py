"""vLLM-compatible configuration source.

Reads ``KVDI_KV_TRANSFER_CONFIG`` (vLLM's ``--kv-transfer-config`` JSON) and ``VLLM_USE_V1``.

The JSON is read in one of two ways:

- kvdi's own names (``{"kv_connector": "redis", "kv_role": ...}``): each key of
  :data:`VLLM_KEYS` lands on its kvdi setting;
- the JSON a ``vllm serve`` gets (``"kv_connector": "KvdiConnector"``, or vLLM's
  ``MultiConnector`` with one ``KvdiConnector`` child): read as kvdi's vLLM adapter reads it,
  the ``kvdi.``-prefixed keys of ``kv_connector_extra_config`` (:func:`adapter_overrides`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource

from kvdi.errors import ConfigError, did_you_mean
from kvdi.settings.paths import MAX_NESTING, flatten, nesting_depth

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
VLLM_CONNECTOR = "KvdiConnector"
MULTI_CONNECTOR = "MultiConnector"
ADAPTER_MODULES = (None, "kvdi.integrations.vllm", "kvdi.integrations.vllm.connector")
EXTRA_PREFIX = "kvdi."
STATS_DIR_KEY = "kvdi_stats_dir"
EVENTS_IDENTITY_KEY = "kvdi_events_identity"  # read by the vLLM adapter (kvdi.integrations.vllm.config)
OWN_KEYS = ("kvdi", STATS_DIR_KEY, EVENTS_IDENTITY_KEY)  # extra-config keys of kvdi's besides the kvdi.-prefixed ones
VLLM_FIELDS = ("kv_role", "engine_id")  # settings taken from vLLM's own transfer-config fields
_HEAD = re.compile(r"[^a-z0-9]")


def transfer_key(where: str) -> Callable[[str], str]:
    """How errors name a setting read from vLLM's transfer config given at ``where``:
    ``--kv-transfer-config key kvdi.redis.url`` (``kv_role``, ``engine_id``: vLLM's own keys)."""
    return lambda dotted: f"{where} key {dotted if dotted.split('.')[0] in VLLM_FIELDS else EXTRA_PREFIX + dotted}"


def _distance(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) that turn ``a`` into ``b``."""
    rows = [list(range(len(b) + 1))]
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            row.append(min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (ca != cb)))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def kvdi_lookalike(key: str) -> str | None:
    """The kvdi key ``key`` was probably meant to be, when it looks like kvdi's but is not read by kvdi.

    A key looks like kvdi's when it is within two edits of ``kvdi_stats_dir`` or ``kvdi_events_identity``, or
    when its head (up to the first character that is not a letter or digit) is within one edit of ``kvdi``
    (``kvd.shared_storage.path``, ``KVDI.redis.url``, ``kvdi_redis.url``). Returns None for
    kvdi's own keys and for every other connector's.
    """
    if key in OWN_KEYS or key.startswith(EXTRA_PREFIX) or len(key) > 200:
        return None
    lower = key.lower()
    for own in OWN_KEYS[1:]:
        if _distance(lower, own) <= 2:
            return own
    head = _HEAD.split(lower, maxsplit=1)[0]
    if len(head) >= 3 and _distance(head, "kvdi") <= 1:
        rest = key[len(head) :]
    elif lower.startswith("kvdi"):
        rest = key[4:]
    else:
        return None
    rest = rest.lstrip("._:-/ ")
    return EXTRA_PREFIX + rest if rest else "kvdi"


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
    if data.get("kv_connector") in (VLLM_CONNECTOR, MULTI_CONNECTOR):
        return adapter_overrides(data, TRANSFER_CONFIG_ENV)
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


def is_adapter_config(raw: str | None) -> bool:
    """True when ``raw`` is JSON that selects kvdi's vLLM adapter (``KvdiConnector`` or ``MultiConnector``)."""
    try:
        data = json.loads(raw or "")
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("kv_connector") in (VLLM_CONNECTOR, MULTI_CONNECTOR)


def kvdi_child(data: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """The ``KvdiConnector`` part of vLLM's transfer config and where it sits (``""`` or ``connectors[i]``).

    For ``MultiConnector`` that is its one ``KvdiConnector`` child, which inherits the parent's
    ``kv_role`` and ``engine_id`` as vLLM's MultiConnector does. ConfigError when no
    ``KvdiConnector`` is configured, when several are, or when the child names another module.
    """
    if data.get("kv_connector") == MULTI_CONNECTOR:
        extra = data.get("kv_connector_extra_config") or {}
        children = extra.get("connectors") if isinstance(extra, dict) else None
        if not isinstance(children, list):
            raise ConfigError(f"{where}: MultiConnector needs kv_connector_extra_config.connectors, a list")
        found = [
            (i, c) for i, c in enumerate(children) if isinstance(c, dict) and c.get("kv_connector") == VLLM_CONNECTOR
        ]
        if len(found) != 1:
            raise ConfigError(
                f"{where}: MultiConnector has {len(found)} {VLLM_CONNECTOR} children; kvdi reads exactly one"
            )
        index, child = found[0]
        place, data = f"connectors[{index}] ", {**{k: data[k] for k in ("kv_role", "engine_id") if k in data}, **child}
    elif data.get("kv_connector") == VLLM_CONNECTOR:
        place = ""
    else:
        raise ConfigError(
            f"{where}: kv_connector is {data.get('kv_connector')!r}, not {VLLM_CONNECTOR} or a {MULTI_CONNECTOR} "
            f"with a {VLLM_CONNECTOR} child; nothing of kvdi's to read"
        )
    module = data.get("kv_connector_module_path")
    if module not in ADAPTER_MODULES:
        raise ConfigError(
            f"{where}: {place}kv_connector_module_path={module!r} is not kvdi's; leave it out (kvdi's vLLM plugin "
            f"registers {VLLM_CONNECTOR}) or set it to kvdi.integrations.vllm"
        )
    return place.strip(), data


def extra_config_overrides(extra: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """Nested kvdi overrides from vLLM's extra config, the one parser of it: ``{"kvdi.redis.url": u}`` (or
    ``{"kvdi": {"redis": {"url": u}}}``) -> ``{"redis": {"url": u}}``; other keys belong to vLLM or other
    connectors and are ignored. ``where`` prefixes error messages (the config's origin)."""
    at = f"{where}: " if where else ""
    for key in extra:
        meant = kvdi_lookalike(str(key))
        if meant is not None:
            raise ConfigError(
                f"{at}kv_connector_extra_config key {str(key)[:80]!r} is not read by kvdi (did you mean {meant!r}?); "
                f"kvdi reads {EXTRA_PREFIX!r}-prefixed keys, a 'kvdi' object, {STATS_DIR_KEY!r} and "
                f"{EVENTS_IDENTITY_KEY!r}"
            )
    items: list[tuple[str, Any]] = []
    nested = extra.get("kvdi")
    if isinstance(nested, Mapping):
        items.extend(flatten(nested))
    items.extend((k[len(EXTRA_PREFIX) :], v) for k, v in extra.items() if k.startswith(EXTRA_PREFIX))
    out: dict[str, Any] = {}
    for dotted, value in items:
        parts = [p for p in dotted.split(".") if p]
        if not parts:
            raise ConfigError(f"{at}kv_connector_extra_config key {EXTRA_PREFIX + dotted!r} names no kvdi setting")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{at}kv_connector_extra_config sets kvdi.{part} both as a value and as a section")
            node = child
        node[parts[-1]] = value
    return out


def adapter_overrides(data: dict[str, Any], where: str) -> dict[str, Any]:
    """kvdi settings from vLLM's transfer config, exactly as kvdi's vLLM adapter reads them.

    ``{"kvdi.redis.url": u}`` (or ``{"kvdi": {"redis": {"url": u}}}``) in
    ``kv_connector_extra_config`` becomes ``{"redis": {"url": u}}``; vLLM's ``kv_role`` and
    ``engine_id`` are taken as they are; other extra-config keys belong to vLLM or other
    connectors and are ignored.
    """
    _place, child = kvdi_child(data, where)
    extra = child.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{where}: kv_connector_extra_config must be a JSON object")
    out = extra_config_overrides(extra, where)
    out["kv_role"] = child.get("kv_role") or "kv_both"
    if child.get("engine_id") is not None:
        out["engine_id"] = str(child["engine_id"])
    # kv_load_failure_policy stays the user's (kvdi.kv_load_failure_policy, default recompute): the adapter hands it
    # to vLLM (kvdi.integrations.vllm.config.adopt_load_failure_policy), so it is what happens to a bad object.
    return out


__all__ = [
    "ADAPTER_MODULES",
    "STATS_DIR_KEY",
    "TRANSFER_CONFIG_ENV",
    "VLLM_KEYS",
    "VLLM_USE_V1_ENV",
    "VllmCompatSource",
    "adapter_overrides",
    "extra_config_overrides",
    "is_adapter_config",
    "kvdi_child",
    "kvdi_lookalike",
    "parse_transfer_config",
    "transfer_key",
]
