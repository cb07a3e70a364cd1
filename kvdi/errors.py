"""kvdi's error hierarchy: one class per failure a user can act on.

Every message names what was wrong (the setting and its env var, the bad value), what is
allowed, and how to fix it, so the CLI can print it as one line.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""`` if none is close."""
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class KvdiError(Exception):
    """Base class of every error kvdi raises on purpose."""


class ConfigError(KvdiError, ValueError):
    """A setting is missing, malformed or out of range; the message names its env var."""


class UnknownConnectorError(ConfigError):
    """``kv_connector`` names no registered connector."""

    def __init__(self, name: str, registered: Iterable[str]) -> None:
        names = sorted(registered)
        super().__init__(
            f"KVDI_KV_CONNECTOR={name!r} is not a registered connector; "
            f"registered: {', '.join(names)}{did_you_mean(name, names)}"
        )
        self.name = name
        self.registered = names


class DuplicateConnectorError(KvdiError):
    """A connector name is registered twice with different targets."""


class ConnectorImportError(KvdiError, ImportError):
    """A connector's module or class could not be imported."""

    def __init__(self, target: str, cause: BaseException, hint: str = "") -> None:
        module, _, attr = target.partition(":")
        super().__init__(
            f"cannot import connector class {attr or '?'!r} from module {module!r}: "
            f"{type(cause).__name__}: {cause}{hint}"
        )
        self.target = target
        self.cause = cause


class ConnectorTypeError(KvdiError, TypeError):
    """A connector target is not a subclass of its role's base class, or built for the wrong role."""


class V1EngineRequiredError(ConfigError):
    """A connector was requested while the V1 engine gate is off."""

    def __init__(self, source: str) -> None:
        super().__init__(
            f"KV connectors need the V1 engine, but the V1 gate is off ({source}); "
            "set KVDI_USE_V1=1 (or unset VLLM_USE_V1=0) to enable it"
        )


class AllocationError(KvdiError):
    """The KV cache budget cannot be met; the message carries the numbers."""


class BackendUnavailableError(KvdiError):
    """The selected connector's backend cannot serve: store folder not writable, server unreachable..."""


class KVLoadError(KvdiError):
    """Loading external KV failed and ``kv_load_failure_policy`` is ``fail``."""
