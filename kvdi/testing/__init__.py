"""Test support for kvdi users: isolated containers, provider overrides, recording connectors.

The pytest plugin (:mod:`kvdi.testing.plugin`, registered through ``pytest11``) provides the
fixtures ``kvdi_env``, ``kvdi_overrides``, ``kvdi_container``, ``kvdi_kv_container`` and
``kvdi_override``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from dependency_injector import providers

from kvdi.connectors.base import SchedulerConnector, WorkerConnector
from kvdi.containers import EngineContainer, KVTransferContainer
from kvdi.testing.recording import Call, CallLog, RecordingSchedulerConnector, RecordingWorkerConnector


def _kv(container: EngineContainer | KVTransferContainer) -> Any:
    # Instances of declarative containers are DynamicContainers: look for the sub-container.
    return getattr(container, "kv", container)


@contextmanager
def override_connector(
    container: EngineContainer | KVTransferContainer,
    *,
    scheduler: SchedulerConnector | None = None,
    worker: WorkerConnector | None = None,
) -> Iterator[None]:
    """Make the container hand out the given connector halves inside the ``with`` block only."""
    kv = _kv(container)
    with ExitStack() as stack:
        if scheduler is not None:
            stack.enter_context(kv.scheduler_connector.override(providers.Object(scheduler)))
        if worker is not None:
            stack.enter_context(kv.worker_connector.override(providers.Object(worker)))
        yield


@contextmanager
def override_allocator(container: EngineContainer, allocator: Any) -> Iterator[None]:
    """Make the container hand out ``allocator`` (e.g. a pre-allocated one) inside the ``with`` block only."""
    with container.alloc.allocator.override(providers.Object(allocator)):
        yield


def recording_halves(
    container: EngineContainer | KVTransferContainer, *, delegate: bool = True
) -> tuple[RecordingSchedulerConnector, RecordingWorkerConnector, CallLog]:
    """Recording halves sharing one log, wrapping the container's real halves when ``delegate``."""
    kv = _kv(container)
    inner_s = kv.scheduler_connector()
    inner_w = kv.worker_connector()
    log = CallLog()
    sched = RecordingSchedulerConnector(inner_s.context, inner_s if delegate else None, log)
    work = RecordingWorkerConnector(inner_w.context, inner_w if delegate else None, log)
    return sched, work, log


__all__ = [
    "Call",
    "CallLog",
    "RecordingSchedulerConnector",
    "RecordingWorkerConnector",
    "override_allocator",
    "override_connector",
    "recording_halves",
]
