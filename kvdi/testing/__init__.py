"""Test support for kvdi users: isolated containers, provider overrides, recording connectors.

The pytest plugin (:mod:`kvdi.testing.plugin`, registered through ``pytest11``) provides the
fixtures ``kvdi_env``, ``kvdi_overrides``, ``kvdi_container``, ``kvdi_kv_container`` and
``kvdi_override``.

Every helper takes a container instance or the ``providers.Container`` that composes it into
an application (``app.engine``), typed as :data:`~kvdi.containers.KvdiContainer`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from dependency_injector import providers

from kvdi.connectors.base import SchedulerConnector, WorkerConnector
from kvdi.containers import EngineContainer, KvdiContainer
from kvdi.testing.recording import Call, CallLog, RecordingSchedulerConnector, RecordingWorkerConnector


def _kv(container: KvdiContainer) -> Any:
    # Instances of declarative containers are DynamicContainers, and a providers.Container passes
    # attribute access on to the one it holds: look for the kv sub-container either way.
    return getattr(container, "kv", container)


@contextmanager
def override_connector(
    container: KvdiContainer,
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
def override_allocator(
    container: EngineContainer | providers.Container[EngineContainer], allocator: Any
) -> Iterator[None]:
    """Make the container hand out ``allocator`` (e.g. a pre-allocated one) inside the ``with`` block only."""
    alloc: Any = container.alloc
    with alloc.allocator.override(providers.Object(allocator)):
        yield


def recording_halves(
    container: KvdiContainer, *, delegate: bool = True
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
