"""vLLM plugin (entry point ``vllm.general_plugins``): registers :class:`KvdiConnector` with vLLM's connector factory.

With kvdi installed, vLLM calls :func:`register` in every process it starts (API server,
engine core, workers), so ``--kv-transfer-config '{"kv_connector": "KvdiConnector", ...}'``
works without ``kv_connector_module_path``, and vLLM's ``MultiConnector`` can rebuild a
kvdi child's stats by its registered name (``KVConnectorFactory.get_connector_class_by_name``).

Registration is lazy (vLLM imports :mod:`kvdi.integrations.vllm.connector` only when a
connector is built) and idempotent: vLLM may load plugins several times per process.
Setting ``VLLM_PLUGINS`` to a list without ``kvdi`` turns the plugin off. When another plugin
registered the name ``KvdiConnector`` first, kvdi leaves it (vLLM refuses a second
registration) and logs one warning line naming what holds the name and how to reach kvdi's.

It also hands kvdi's loggers (``kvdi.*``) to vLLM's log handler (:func:`route_logs_to_vllm`), so
kvdi's warnings (a store down, a failed save) read like vLLM's lines: process, pid, level,
timestamp, file and line.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

CONNECTOR_NAME = "KvdiConnector"
CONNECTOR_MODULE = "kvdi.integrations.vllm.connector"

logger = logging.getLogger(__name__)


class ToVllmHandlers(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers as they are when it is emitted (vLLM configures them
    after plugins load, and may configure them again), so kvdi's lines come out in vLLM's format."""

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger("vllm").handlers
        if not handlers and not logging.getLogger().handlers:  # nobody configured logging: Python's last resort
            handlers = [logging.lastResort] if logging.lastResort is not None else []
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def route_logs_to_vllm() -> bool:
    """Send the ``kvdi`` logger's records through vLLM's handlers (:class:`ToVllmHandlers`) at vLLM's level.

    vLLM's format: process name, pid, level, timestamp, file:line, message. Records still propagate
    to the root logger (where an application or pytest may listen). Idempotent; returns whether it
    added the handler.
    """
    import vllm.envs as envs

    kvdi = logging.getLogger("kvdi")
    if any(isinstance(h, ToVllmHandlers) for h in kvdi.handlers):
        return False
    kvdi.addHandler(ToVllmHandlers())
    kvdi.setLevel(str(envs.VLLM_LOGGING_LEVEL).upper())
    return True


def register() -> None:
    """Register ``KvdiConnector`` with vLLM's ``KVConnectorFactory`` unless a connector of that name exists
    (someone else's: one warning line naming it); route kvdi's logs to vLLM's handler."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    route_logs_to_vllm()

    if is_registered():
        holder = registered_as(getattr(KVConnectorFactory, "_registry", {}).get(CONNECTOR_NAME))
        if holder != f"{CONNECTOR_MODULE}:{CONNECTOR_NAME}":
            logger.warning(
                "vLLM's connector name %r is already registered by %s, not kvdi: kvdi's plugin leaves it; "
                'to use kvdi\'s, add "kv_connector_module_path": %r to --kv-transfer-config',
                CONNECTOR_NAME,
                holder,
                CONNECTOR_MODULE,
            )
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)


def registered_as(loader: Any) -> str:
    """``module:Class`` a vLLM factory loader imports (read from its closure), or a description of it."""
    try:
        names = inspect.getclosurevars(loader).nonlocals
    except TypeError:
        names = {}
    module, cls = names.get("module_path"), names.get("class_name")
    if isinstance(module, str) and isinstance(cls, str):
        return f"{module}:{cls}"
    return f"an unknown loader {getattr(loader, '__qualname__', type(loader).__name__)!r}"


def is_registered() -> bool:
    """True when vLLM's connector factory knows ``KvdiConnector`` by name (vLLM has no public query for it)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {})


__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "is_registered",
    "register",
    "registered_as",
    "route_logs_to_vllm",
    "ToVllmHandlers",
]
