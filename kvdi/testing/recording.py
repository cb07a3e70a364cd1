"""Recording connectors: log every call (and delegate to a real half when given one).

Inject them through the container (``kvdi_override`` fixture or :func:`override_connector`)
to assert which connector methods an engine called, and in which order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvdi.connectors.base import (
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorMetadata,
    KVRequest,
    SchedulerConnector,
    SchedulerOutput,
    WorkerConnector,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Call:
    """One recorded call: the half (``scheduler``/``worker``), the method and its arguments."""

    half: str
    method: str
    args: tuple[Any, ...] = ()


@dataclass
class CallLog:
    """Calls of one or both halves, in order."""

    calls: list[Call] = field(default_factory=list)

    def methods(self, half: str | None = None) -> list[str]:
        """Method names in call order, optionally for one half only."""
        return [c.method for c in self.calls if half is None or c.half == half]

    def record(self, half: str, method: str, *args: Any) -> None:
        self.calls.append(Call(half, method, args))


class RecordingSchedulerConnector(SchedulerConnector):
    """Scheduler half that logs calls; delegates to ``inner`` if given, else offers nothing."""

    def __init__(self, context: ConnectorContext, inner: SchedulerConnector | None = None, log: CallLog | None = None):
        super().__init__(context)
        self.inner = inner
        self.log = log if log is not None else CallLog()
        if inner is not None:
            self.stats = inner.stats

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.log.record("scheduler", "get_num_new_matched_tokens", request.request_id, num_computed_tokens)
        return self.inner.get_num_new_matched_tokens(request, num_computed_tokens) if self.inner else (0, False)

    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self.log.record(
            "scheduler", "update_state_after_alloc", request.request_id, tuple(block_ids), num_external_tokens
        )
        if self.inner:
            self.inner.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        self.log.record("scheduler", "build_connector_meta", output.step)
        return self.inner.build_connector_meta(output) if self.inner else BlockTransferMetadata()

    def request_finished(self, request: KVRequest, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        self.log.record("scheduler", "request_finished", request.request_id, tuple(block_ids))
        return self.inner.request_finished(request, block_ids) if self.inner else (False, None)

    def shutdown(self) -> None:
        self.log.record("scheduler", "shutdown")
        if self.inner:
            self.inner.shutdown()


class RecordingWorkerConnector(WorkerConnector):
    """Worker half that logs calls; delegates to ``inner`` if given, else moves nothing."""

    def __init__(self, context: ConnectorContext, inner: WorkerConnector | None = None, log: CallLog | None = None):
        super().__init__(context)
        self.inner = inner
        self.log = log if log is not None else CallLog()
        if inner is not None:
            self.stats = inner.stats

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.log.record("worker", "register_kv_caches", tuple(kv_caches))
        if self.inner:
            self.inner.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self.log.record("worker", "bind_connector_metadata", metadata)
        super().bind_connector_metadata(metadata)
        if self.inner:
            self.inner.bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        self.log.record("worker", "clear_connector_metadata")
        super().clear_connector_metadata()
        if self.inner:
            self.inner.clear_connector_metadata()

    def start_load_kv(self) -> None:
        self.log.record("worker", "start_load_kv")
        if self.inner:
            self.inner.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.log.record("worker", "wait_for_layer_load", layer_name)
        if self.inner:
            self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        self.log.record("worker", "save_kv_layer", layer_name)
        if self.inner:
            self.inner.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self.log.record("worker", "wait_for_save")
        if self.inner:
            self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.log.record("worker", "get_finished", frozenset(finished_req_ids))
        return self.inner.get_finished(finished_req_ids) if self.inner else (None, None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.log.record("worker", "get_block_ids_with_load_errors")
        mine = super().get_block_ids_with_load_errors()
        return mine | self.inner.get_block_ids_with_load_errors() if self.inner else mine

    def shutdown(self) -> None:
        self.log.record("worker", "shutdown")
        if self.inner:
            self.inner.shutdown()
