"""The ``null`` connector: loads nothing, saves nothing. The baseline every engine can run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvdi.connectors.base import (
    BlockTransferMetadata,
    KVConnectorMetadata,
    KVRequest,
    SchedulerConnector,
    SchedulerOutput,
    WorkerConnector,
)

if TYPE_CHECKING:
    import torch


class NullSchedulerConnector(SchedulerConnector):
    """Never offers tokens; counts lookups so engines can be compared with it."""

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self.stats.lookups += 1
        return 0, False

    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        return BlockTransferMetadata()


class NullWorkerConnector(WorkerConnector):
    """Moves no bytes."""

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        return None

    def start_load_kv(self) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
