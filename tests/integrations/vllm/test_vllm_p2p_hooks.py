"""What the vLLM adapter needs to drive p2p, without vLLM: the bridge keeps p2p's asynchronous loads
(as in-step loads plus markers), and the check that tells a scheduler process from a worker process."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace

import pytest
import torch

from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorMetadata,
    KVConnectorRole,
    WorkerConnector,
)
from kvdi.connectors.p2p.scheduler import P2pTransferMetadata
from kvdi.integrations.vllm.bridge import LayoutBridge
from kvdi.integrations.vllm.config import worker_elsewhere
from kvdi.integrations.vllm.layout import kvdi_layer_view
from kvdi.layout import KVCacheSpec
from kvdi.registry import ConnectorRegistry
from kvdi.settings import load_settings

SPEC = KVCacheSpec("m", 2, 2, 32, 32, "float32")


class _Worker(WorkerConnector):
    def __init__(self) -> None:
        super().__init__(ConnectorContext("fake", KVConnectorRole.WORKER, load_settings(), SPEC))
        self.started: list[KVConnectorMetadata | None] = []

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        assert all(t.is_contiguous() for t in kv_caches.values())

    def start_load_kv(self) -> None:
        self.started.append(self.metadata)

    def wait_for_save(self) -> None:
        pass


def test_the_bridge_keeps_p2p_metadata_and_turns_its_async_loads_into_step_loads_plus_markers() -> None:
    """Through scratch a p2p async load runs in the step (scratch is reused next step); the marker keeps
    the request's report (finished receiving) and the metadata stays p2p's, so the worker half sees it."""
    vllm_cache = {f"layers.{i}": torch.zeros(2, 6, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim) for i in range(2)}
    worker = _Worker()
    bridge = LayoutBridge({n: kvdi_layer_view(t, SPEC, num_blocks=6) for n, t in vllm_cache.items()}, worker)
    assert not bridge.direct
    meta = P2pTransferMetadata(
        loads=(BlockTransfer("sync", (4,), (b"k4",)),),
        async_loads=(BlockTransfer("async", (2, 3), (b"k2", b"k3")),),
    )
    worker.bind_connector_metadata(bridge.bind(meta))
    bridge.load(worker.start_load_kv)
    [bridged] = worker.started
    assert isinstance(bridged, P2pTransferMetadata)
    assert [(t.request_id, t.block_ids, t.block_keys) for t in bridged.loads] == [
        ("sync", (0,), (b"k4",)),
        ("async", (1, 2), (b"k2", b"k3")),
    ]
    assert bridged.async_loads == (BlockTransfer("async", (), ()),)


def test_plain_metadata_stays_plain_through_the_bridge() -> None:
    vllm_cache = {f"layers.{i}": torch.zeros(2, 6, SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim) for i in range(2)}
    worker = _Worker()
    bridge = LayoutBridge({n: kvdi_layer_view(t, SPEC, num_blocks=6) for n, t in vllm_cache.items()}, worker)
    worker.bind_connector_metadata(bridge.bind(BlockTransferMetadata(loads=(BlockTransfer("r", (5,), (b"k",)),))))
    bridge.load(worker.start_load_kv)
    [bridged] = worker.started
    assert type(bridged) is BlockTransferMetadata and bridged.loads[0].block_ids == (0,)


@pytest.mark.parametrize(("executor", "elsewhere"), [("uni", False), ("external_launcher", False), ("mp", True)])
def test_the_worker_runs_elsewhere_under_a_multiprocess_executor(executor: str, elsewhere: bool) -> None:
    config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=executor))
    assert worker_elsewhere(config) is elsewhere


def test_only_p2p_declares_a_scheduler_only_backend_and_it_resolves() -> None:
    """The adapter overrides the backend of a scheduler half in its own process with this factory."""
    from kvdi.connectors.p2p.lookup import open_lookups
    from kvdi.registry import import_target

    registry = ConnectorRegistry()
    declared = {name: registry.resolve(name).spec.scheduler_backend for name in ("p2p", "shared_storage", "null")}
    assert declared["shared_storage"] is None and declared["null"] is None
    assert declared["p2p"] is not None and import_target(declared["p2p"]) is open_lookups
