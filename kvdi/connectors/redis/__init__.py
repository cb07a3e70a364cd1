"""The ``redis`` connector's backend: one Redis key per framed block, on one server or a Redis Cluster.

:func:`open_store` is the ``backend`` target of the ``redis`` connector spec; the generic
halves in :mod:`kvdi.connectors.store` do the rest. ``KVDI_REDIS__CLUSTER`` picks
:class:`RedisBlockStore` (one server, :mod:`.server`) or :class:`RedisClusterBlockStore`
(:mod:`.cluster`); both bound every read to one frame, check every reply's type, and put
each server behind a :class:`CircuitBreaker` (:mod:`.breaker`). This package is the only
part of kvdi that imports ``redis``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdi.connectors.redis.breaker import BreakerOpenError, BreakerState, CircuitBreaker
from kvdi.connectors.redis.cluster import RedisClusterBlockStore
from kvdi.connectors.redis.server import RedisBlockStore, RedisNode
from kvdi.connectors.redis.wire import send_gathered
from kvdi.connectors.store.canonical_store import CanonicalBlockStore, canonical_object_bytes, refuse_compression
from kvdi.connectors.store.codec import compressor_for
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.integrity import frame_key
from kvdi.layout import DTYPE_BYTES
from kvdi.masking import MASK, mask_url

if TYPE_CHECKING:
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import KvdiSettings, RedisSettings

FRAME_ROOM = 64
"""Bytes a read may return beyond header + payload (room for a trailer such as a keyed MAC);
reads never return more than ``HEADER_SIZE + block_bytes + FRAME_ROOM + 1`` bytes per object."""


def open_store(
    options: RedisSettings, layout: KVCacheSpec, settings: KvdiSettings
) -> RedisBlockStore | RedisClusterBlockStore | CanonicalBlockStore:
    """The ``redis`` connector's backend: a store on the server or cluster ``KVDI_REDIS__URL`` names (lazy).
    With ``format="canonical"`` each key holds one canonical section (:class:`CanonicalBlockStore`)."""
    compressor = compressor_for(
        options.compression, frame_key(settings), "KVDI_REDIS__COMPRESSION", DTYPE_BYTES[layout.dtype]
    )
    canonical = options.format == "canonical"
    if canonical:
        refuse_compression("KVDI_REDIS", options.compression, compressor)
    grid = (options.section_layers, options.section_heads)
    size = canonical_object_bytes(layout, grid, "KVDI_REDIS") if canonical else None
    limit = (size or HEADER_SIZE + layout.block_bytes) + FRAME_ROOM
    store: RedisBlockStore | RedisClusterBlockStore
    if options.cluster:
        store = RedisClusterBlockStore(options, max_object_bytes=limit)
    else:
        store = RedisBlockStore(options, max_object_bytes=limit)
    store.compressor = compressor  # blocks are read whole then (codec.read_capabilities), not into the cache
    return CanonicalBlockStore(store, layout, frame_key(settings), grid) if canonical else store


__all__ = [
    "FRAME_ROOM",
    "MASK",
    "BreakerOpenError",
    "BreakerState",
    "CircuitBreaker",
    "RedisBlockStore",
    "RedisClusterBlockStore",
    "RedisNode",
    "mask_url",
    "open_store",
    "send_gathered",
]
