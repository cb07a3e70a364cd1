"""What ``kvdi check`` adds to "it opens": warnings an operator acts on, and input errors that point at the mistake.

- :func:`check_warnings`: a Redis store whose server evicts nothing (``maxmemory_policy
  noeviction``: once its memory is full every save fails, and with ``maxmemory 0`` it grows
  until the host runs out), and a ``shared_storage`` folder without a size cap on a disk with
  less than :data:`SMALL_DISK_BYTES` free (it fills the disk), and an ``s3`` bucket with no enabled
  lifecycle rule expiring kvdi's prefix (it only grows).
- :func:`json_error`: ``--vllm-config`` that is not JSON, named by line and column with the
  text around the mistake.
- :func:`check_connector_names`: a ``kv_connector`` in ``--vllm-config`` that vLLM does not
  register (at the top, or a child of vLLM's ``MultiConnector``) but is a near miss of one (or
  of kvdi's ``KvdiConnector``) is an error with a did-you-mean; other names (a plugin's, or one
  with its own ``kv_connector_module_path``) are left to vLLM.

Stores are told apart by the backend their connector spec names (as ``kvdi store`` does).
"""

from __future__ import annotations

import difflib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvdi.errors import ConfigError

SMALL_DISK_BYTES = 64 << 30
"""Free space under which an uncapped ``shared_storage`` folder earns a warning."""
REDIS_BACKEND = "kvdi.connectors.redis:open_store"
FILES_BACKEND = "kvdi.connectors.shared_storage:open_store"
S3_BACKEND = "kvdi.connectors.s3:open_store"
VLLM_CONNECTORS = (
    "DecodeBenchConnector", "ExampleConnector", "ExampleHiddenStatesConnector", "FlexKVConnectorV1",
    "HF3FSKVConnector", "HiSparseConnector", "LMCacheConnectorV1", "LMCacheMPConnector", "MoRIIOConnector",
    "MooncakeConnector", "MooncakeStoreConnector", "MultiConnector", "NixlConnector", "NixlPullConnector",
    "NixlPushConnector", "OffloadingConnector", "SimpleCPUOffloadConnector",
)  # fmt: skip
"""The connector names vLLM 0.32 registers (``KVConnectorFactory``), for did-you-mean only."""
KNOWN_CONNECTORS = ("KvdiConnector", *VLLM_CONNECTORS)
CLOSE = 0.85
"""How alike (difflib's ratio) a name must be to a known connector to be taken for a typo of it: every name ends in
``Connector``, so a looser bound would take any other connector (a plugin's) for a typo."""


def json_error(exc: json.JSONDecodeError, option: str = "--vllm-config") -> ConfigError:
    """The error for JSON that does not parse: where (line, column) and the text around it."""
    start = max(exc.pos - 20, 0)
    near = exc.doc[start : exc.pos + 20].replace("\n", " ")
    return ConfigError(
        f"{option} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno} (near {near!r}); "
        "pass vLLM's --kv-transfer-config JSON object"
    )


def _unknown(entry: dict[str, Any], where: str) -> None:
    name = entry.get("kv_connector")
    if not isinstance(name, str) or name in KNOWN_CONNECTORS or entry.get("kv_connector_module_path"):
        return  # a known name, or a connector of its own module (anything goes)
    same = [c for c in KNOWN_CONNECTORS if c.lower() == name.lower()]
    close = same or difflib.get_close_matches(name, KNOWN_CONNECTORS, n=1, cutoff=CLOSE)
    if close:
        raise ConfigError(
            f"--vllm-config: {where}={name!r} is not a connector vLLM registers (did you mean {close[0]!r}?)"
        )


def check_connector_names(data: dict[str, Any]) -> None:
    """ConfigError with a did-you-mean when ``kv_connector`` (or a MultiConnector child's) is close to a connector
    vLLM registers but is none; names vLLM does not know and that resemble none are left to vLLM."""
    _unknown(data, "kv_connector")
    extra = data.get("kv_connector_extra_config")
    multi = data.get("kv_connector") == "MultiConnector" and isinstance(extra, dict)
    children = extra.get("connectors") if multi else None  # type: ignore[union-attr]
    for i, child in enumerate(children if isinstance(children, list) else []):
        if isinstance(child, dict):
            _unknown(child, f"kv_connector_extra_config.connectors[{i}].kv_connector")


def _backends(container: Any) -> Iterator[str]:
    """The backend of the selected connector and of each of its tiers."""
    yield container.kv.connector().spec.backend or ""
    for tier in container.kv.tiers():
        yield tier.connector.spec.backend or ""


def _redis_warnings(settings: Any, summary: str) -> list[str]:
    if "noeviction" in summary:  # the store's own probe already said it (maxmemory set)
        return []
    import redis
    from redis.cluster import RedisCluster

    from kvdi.connectors.redis.server import client_options

    url = settings.redis.url.get_secret_value()
    client: Any = (
        RedisCluster.from_url(url, **client_options(settings.redis))
        if settings.redis.cluster
        else redis.Redis.from_url(url, **client_options(settings.redis))
    )
    try:
        info = client.info("memory")
    except Exception as exc:  # INFO refused (an ACL) or the server went away since the probe: say so, do not fail
        from kvdi.masking import mask_text

        return [f"redis memory policy unknown (INFO memory: {type(exc).__name__}: {mask_text(str(exc))})"]
    finally:
        client.close()
    nodes = info.values() if settings.redis.cluster else [info]
    policies = {(str(n.get("maxmemory_policy")), int(n.get("maxmemory") or 0)) for n in nodes if isinstance(n, dict)}
    return [
        f"redis maxmemory_policy is noeviction (maxmemory {limit or 'unlimited'}): once the server's memory is full "
        "every save fails (and with no maxmemory it grows until the host runs out); set maxmemory and an eviction "
        "policy such as allkeys-lru"
        for policy, limit in sorted(policies)
        if policy == "noeviction"
    ][:1]


def _disk_warnings(settings: Any) -> list[str]:
    if settings.shared_storage.max_bytes:
        return []
    path = Path(settings.shared_storage.path).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return []
    if free >= SMALL_DISK_BYTES:
        return []
    return [
        f"shared_storage at {settings.shared_storage.path} has no size cap and its disk has {free / 2**30:.1f} GiB "
        "free: the store fills it; set KVDI_SHARED_STORAGE__MAX_BYTES (kvdi.shared_storage.max_bytes)"
    ]


def check_warnings(settings: Any, container: Any, summary: str) -> list[str]:
    """What ``kvdi check`` warns about for the selected connector and its tiers (see the module docstring)."""
    backends = set(_backends(container))
    out: list[str] = []
    if REDIS_BACKEND in backends:
        out += _redis_warnings(settings, summary)
    if FILES_BACKEND in backends:
        out += _disk_warnings(settings)
    if S3_BACKEND in backends:  # no lifecycle rule expiring kvdi's prefix: the bucket only grows
        from kvdi.admin.s3_admin import s3_options
        from kvdi.connectors.s3.probe import lifecycle_warning

        out += [w for w in [lifecycle_warning(s3_options(settings))] if w]
    return out


__all__ = ["SMALL_DISK_BYTES", "VLLM_CONNECTORS", "check_connector_names", "check_warnings", "json_error"]
