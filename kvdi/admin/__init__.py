"""Store administration behind ``kvdi store stats|verify|clear``: what a shared store holds, checked, emptied.

:func:`open_admin` opens the store of the selected connector (``KVDI_KV_CONNECTOR``, or the
one named) from kvdi's settings, by the connector spec's backend: shared_storage folders
(:mod:`.files`) and Redis servers and clusters (:mod:`.redis_admin`). The operations
(:func:`store_stats`, :func:`verify_store`, :func:`clear_store`) are in :mod:`.model`; they only
ever remove an object whose content is a kvdi frame (foreign entries are reported and kept).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvdi.admin.model import (
    BadObject,
    ClearReport,
    ForeignObject,
    StoreAdmin,
    StoreObject,
    VerifyReport,
    check_object,
    clear_store,
    verify_store,
)
from kvdi.admin.select import Selection, parse_age, parse_layout
from kvdi.admin.stats import GroupStats, StoreStats, store_stats
from kvdi.errors import BackendUnavailableError, ConfigError, KvdiError, UnknownConnectorError

if TYPE_CHECKING:
    from kvdi.settings import KvdiSettings


def _files(settings: KvdiSettings) -> StoreAdmin:
    from pathlib import Path

    from kvdi.admin.files import FileStoreAdmin

    root = Path(settings.shared_storage.path).expanduser()
    try:
        return FileStoreAdmin(root)
    except OSError as exc:
        raise ConfigError(
            f"KVDI_SHARED_STORAGE__PATH={str(root)!r}: cannot open it as a store folder "
            f"({exc.strerror or exc}); point it at the store's real directory"
        ) from None


def _redis(settings: KvdiSettings) -> StoreAdmin:
    from kvdi.admin.redis_admin import RedisStoreAdmin

    return RedisStoreAdmin(settings.redis)


_ADMINS: dict[str, Callable[[KvdiSettings], StoreAdmin]] = {
    "kvdi.connectors.shared_storage:open_store": _files,
    "kvdi.connectors.redis:open_store": _redis,
}
"""Administration by the backend a connector spec names, so any connector over these stores is covered."""


def open_admin(settings: KvdiSettings, connector: str | None = None) -> StoreAdmin:
    """The store of ``connector`` (default: ``settings.kv_connector``); ConfigError when it has none to administer,
    BackendUnavailableError (URL masked) when it cannot be reached."""
    from kvdi.masking import mask_text
    from kvdi.registry import ConnectorRegistry

    name = connector or settings.kv_connector
    try:
        spec = ConnectorRegistry().get(name, settings.kv_connector_module_path).spec
    except UnknownConnectorError as exc:
        if connector is None:
            raise
        raise ConfigError(str(exc).replace(f"KVDI_KV_CONNECTOR={name!r}", f"--connector={name!r}")) from None
    opener = _ADMINS.get(spec.backend or "")
    if opener is None:
        raise ConfigError(
            f"KVDI_KV_CONNECTOR={name!r}: kvdi store administers shared stores only (connectors over "
            "shared_storage or redis); select one with KVDI_KV_CONNECTOR or --connector"
        )
    try:
        return opener(settings)
    except KvdiError:
        raise
    except Exception as exc:
        raise BackendUnavailableError(
            f"connector {name!r}: store cannot be opened: {type(exc).__name__}: {mask_text(str(exc))}"
        ) from None


__all__ = [
    "BadObject",
    "ClearReport",
    "ForeignObject",
    "Selection",
    "GroupStats",
    "StoreAdmin",
    "StoreObject",
    "StoreStats",
    "VerifyReport",
    "check_object",
    "clear_store",
    "open_admin",
    "parse_age",
    "parse_layout",
    "store_stats",
    "verify_store",
]
