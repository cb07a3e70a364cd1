"""kvdi: config-driven dependency injection for LLM KV-cache connectors.

``import kvdi`` is light: it imports neither torch nor redis. Build a container with
:func:`build_engine_container` (a whole reference engine) or :func:`build_kv_container`
(just the connector halves), configured by ``KVDI_*`` env, a TOML file or keyword arguments.
"""

from __future__ import annotations

from kvdi.allocator import AllocationPlan, GpuBufferAllocator
from kvdi.connectors.base import (
    BlockTransferMetadata,
    ConnectorContext,
    ConnectorStats,
    KVConnectorMetadata,
    KVConnectorRole,
    KVRequest,
    SchedulerConnector,
    SchedulerOutput,
    WorkerConnector,
)
from kvdi.containers import (
    AllocatorContainer,
    EngineContainer,
    KVTransferContainer,
    build_engine_container,
    build_kv_container,
)
from kvdi.errors import (
    AllocationError,
    BackendUnavailableError,
    ConfigError,
    ConnectorImportError,
    ConnectorTypeError,
    DuplicateConnectorError,
    KvdiError,
    KVLoadError,
    UnknownConnectorError,
    V1EngineRequiredError,
)
from kvdi.layout import KVCacheSpec
from kvdi.registry import ConnectorRegistry, ConnectorSpec
from kvdi.settings import KvdiSettings, load_settings

__version__ = "0.1.0"

__all__ = [
    "AllocationError",
    "AllocationPlan",
    "AllocatorContainer",
    "BackendUnavailableError",
    "BlockTransferMetadata",
    "ConfigError",
    "ConnectorContext",
    "ConnectorImportError",
    "ConnectorRegistry",
    "ConnectorSpec",
    "ConnectorStats",
    "ConnectorTypeError",
    "DuplicateConnectorError",
    "EngineContainer",
    "GpuBufferAllocator",
    "KVCacheSpec",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVLoadError",
    "KVRequest",
    "KVTransferContainer",
    "KvdiError",
    "KvdiSettings",
    "SchedulerConnector",
    "SchedulerOutput",
    "UnknownConnectorError",
    "V1EngineRequiredError",
    "WorkerConnector",
    "build_engine_container",
    "build_kv_container",
    "load_settings",
]
