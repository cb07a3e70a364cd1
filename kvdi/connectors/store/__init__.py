"""Connector halves over a :class:`BlockStore`: shared by shared_storage, cpu_offload, redis and multi.

A BlockStore holds framed objects (see :mod:`kvdi.connectors.store.framing`) by block key and
knows nothing about tensors. The generic halves do the rest: the scheduler half
(:mod:`~kvdi.connectors.store.scheduler`) asks the store how many leading blocks of a
prompt it holds and plans loads and saves; the worker half
(:mod:`~kvdi.connectors.store.worker`) copies blocks between the paged KV cache and
framed objects, verifies every object it loads, and turns any bad object into a miss
(counted, dropped). Transfers may run in the background (``transfer.*`` settings,
:mod:`~kvdi.connectors.store.transfer_queue`). This module is the one import path for all of it.
"""

from __future__ import annotations

from kvdi.connectors.store.framing import Buffer
from kvdi.connectors.store.protocol import (
    BlockStore,
    CheckedStore,
    PlacingStore,
    PrefetchStore,
    ReadIntoStore,
    StoreCapabilities,
    ViewStore,
    prefers_async_load,
    require_store,
    written_count,
)
from kvdi.connectors.store.scheduler import ASYNC_LOAD_MIN_BYTES, StoreSchedulerConnector, StoreTransferMetadata
from kvdi.connectors.store.worker import CHUNK_BYTES, StoreWorkerConnector

__all__ = [
    "ASYNC_LOAD_MIN_BYTES",
    "CHUNK_BYTES",
    "BlockStore",
    "Buffer",
    "CheckedStore",
    "PlacingStore",
    "PrefetchStore",
    "ReadIntoStore",
    "StoreCapabilities",
    "StoreSchedulerConnector",
    "StoreTransferMetadata",
    "StoreWorkerConnector",
    "ViewStore",
    "prefers_async_load",
    "require_store",
    "written_count",
]
