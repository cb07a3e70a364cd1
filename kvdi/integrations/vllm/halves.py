"""Builds the kvdi half behind a :class:`KvdiConnector`: one container's half, or one per KV cache group (vLLM-free).

- :func:`open_single`: the engine's container's scheduler or worker half, with a
  :class:`BlockIndex` standing in for a process-local store in the scheduler's process and
  :class:`AllRanksStore` for a store of per-rank slices (:mod:`.parallel`);
- :func:`open_hybrid`: for a model with several KV cache groups. Each group's blocks are
  stored under keys and frames of the group's own layout
  (:func:`~kvdi.integrations.vllm.groups.group_layout`), so each group gets its own kvdi
  container (shared by the co-located halves of one engine) and its own store worker half.
  Only the store connectors plan per group; anything else is refused with the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from dependency_injector import providers

from kvdi.connectors.base import ConnectorContext, KVConnectorRole, SchedulerConnector, WorkerConnector
from kvdi.connectors.store.protocol import BlockStore
from kvdi.containers import KVTransferContainer
from kvdi.errors import ConfigError
from kvdi.integrations.vllm.block_index import BlockIndex, store_capacity_blocks
from kvdi.integrations.vllm.groups import GroupSpec
from kvdi.integrations.vllm.hybrid import HybridScheduler, HybridWorker, group_layouts
from kvdi.integrations.vllm.parallel import AllRanksStore, RankSlice
from kvdi.integrations.vllm.requests import RequestTracker
from kvdi.integrations.vllm.shared import SHARED
from kvdi.layout import KVCacheSpec
from kvdi.registry import import_target


def open_single(
    container: KVTransferContainer, worker: bool, shape: RankSlice, index_mode: bool, worker_elsewhere: bool = False
) -> tuple[SchedulerConnector | WorkerConnector, BlockIndex | None]:
    """The container's ``worker`` (or scheduler) half, and the scheduler's :class:`BlockIndex` in index mode.

    ``worker_elsewhere``: vLLM builds the worker role in another process; a spec's ``scheduler_backend``
    (p2p: only the worker process pairs) then stands in for the backend of the scheduler half."""
    if shape.sliced:
        check_parallel(container, shape, index_mode)  # before building a half (p2p's would wait for its peer)
    if worker:
        return cast(WorkerConnector, container.worker_connector()), None
    index = None
    if index_mode:
        index = block_index(container)
    elif shape.sliced:
        backend = cast(BlockStore, container.backend())
        container.backend.override(providers.Object(AllRanksStore(backend, shape)))
    elif (only := container.connector().spec.scheduler_backend) and worker_elsewhere:
        # p2p: the worker process pairs; this process must not bind the rendezvous store too
        factory = providers.Resource(import_target(only), container.options, container.layout, container.settings)
        container.backend.override(factory)
    return cast(SchedulerConnector, container.scheduler_connector()), index


def block_index(container: KVTransferContainer) -> BlockIndex:
    """A key index sized like the worker's store, standing in for the backend in this process."""
    capacity = store_capacity_blocks(container.backend())
    container.backend.shutdown()  # this process only needed its size; the worker holds the blocks
    if capacity is None:
        raise ConfigError(
            f"connector {container.connector().spec.name!r} is process-local but its backend does not say "
            "how many blocks it holds (num_slots); run vLLM with distributed_executor_backend='uni'"
        )
    index = BlockIndex(capacity)
    container.backend.override(providers.Object(index))
    return index


def check_parallel(container: KVTransferContainer, shape: RankSlice, index_mode: bool) -> None:
    """Refuse what cannot store per-rank slices: stores in one worker's memory, non-store connectors."""
    resolved = container.connector()
    if index_mode or not resolved.stores_rank_slices:  # the spec decides (kvdi.registry.ResolvedConnector)
        raise ConfigError(
            f"kvdi.kv_connector={resolved.spec.name!r} does not support tensor_parallel_size="
            f"{shape.tp_size} / pipeline_parallel_size={shape.pp_size}: with more than one "
            "rank each rank stores its own slice in a store every process reaches; pick a store connector "
            "that is not process-local (`kvdi connectors` lists them)"
        )


def open_hybrid(
    container: KVTransferContainer,
    worker: bool,
    groups: Sequence[GroupSpec],
    layout: KVCacheSpec,
    settings_kwargs: dict[str, Any],
    shape: RankSlice,
    tracker: RequestTracker,
    index_mode: bool,
) -> HybridScheduler | HybridWorker:
    """The hybrid scheduler or worker half over ``groups``; each group's container is released by its shutdown."""
    resolved = container.connector()
    spec = resolved.spec
    if index_mode or not resolved.store_halves:  # the spec decides (kvdi.registry.ResolvedConnector)
        raise ConfigError(
            f"kvdi.kv_connector={spec.name!r} cannot store a model with {len(groups)} KV cache groups "
            f"({', '.join(g.kind for g in groups)}): pick a store connector (`kvdi connectors` lists them; "
            "a process-local one needs distributed_executor_backend='uni'), or run vLLM with "
            "--disable-hybrid-kv-cache-manager (sliding-window models only)"
        )
    settings = container.settings()
    engine_id = settings.engine_id
    layouts = group_layouts(layout, groups, shape, worker)
    ids = [f"{engine_id}#group{g.index}" for g in groups]
    acquired: list[str] = []
    try:
        per_group = []
        for gid, glayout in zip(ids, layouts, strict=True):
            per_group.append(SHARED.acquire(gid, settings_kwargs, glayout))
            acquired.append(gid)
        role = KVConnectorRole.WORKER if worker else KVConnectorRole.SCHEDULER
        context = ConnectorContext(spec.name, role, settings, layout)
        if worker:
            halves = [cast(WorkerConnector, c.worker_connector()) for c in per_group]
            return HybridWorker(context, groups, halves, shape, release=lambda: _release(ids))
        stores: list[BlockStore] = [cast(BlockStore, c.backend()) for c in per_group]
        if shape.sliced:
            stores = [AllRanksStore(s, shape) for s in stores]
        return HybridScheduler(context, groups, layouts, stores, tracker, release=lambda: _release(ids))
    except BaseException:
        _release(acquired)
        raise


def _release(ids: Sequence[str]) -> None:
    for gid in ids:
        SHARED.release(gid)


__all__ = ["block_index", "check_parallel", "open_hybrid", "open_single"]
