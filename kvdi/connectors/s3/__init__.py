"""The ``s3`` connector's backend: one S3 object per framed block, in any S3-compatible bucket.

:func:`open_store` is the ``backend`` target of the ``s3`` connector spec; the generic halves in
:mod:`kvdi.connectors.store` do the rest. Options: :class:`~kvdi.connectors.s3.settings.S3Settings`
(``KVDI_S3__*``); the store: :mod:`.store`; boto3: :mod:`.client`; ``kvdi check``: :mod:`.probe`.
See ``docs/s3.md``. This package is the only part of kvdi that imports boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdi.connectors.s3.settings import S3Settings
from kvdi.connectors.s3.store import S3BlockStore
from kvdi.connectors.store.canonical_store import CanonicalBlockStore, canonical_object_bytes, refuse_compression
from kvdi.connectors.store.codec import compressor_for
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.integrity import frame_key
from kvdi.layout import DTYPE_BYTES

if TYPE_CHECKING:
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import KvdiSettings

FRAME_ROOM = 64
"""Bytes a read may return beyond header + payload (room for a trailer such as a keyed MAC)."""


def open_store(options: S3Settings, layout: KVCacheSpec, settings: KvdiSettings) -> S3BlockStore | CanonicalBlockStore:
    """The ``s3`` connector's backend: a store on the bucket ``KVDI_S3__BUCKET`` names. With
    ``format="canonical"`` each object is one canonical section (:class:`CanonicalBlockStore`): a ranged
    read bounded to one section, verified before any byte lands; absent or bad is a counted miss."""
    compressor = compressor_for(
        options.compression, frame_key(settings), "KVDI_S3__COMPRESSION", DTYPE_BYTES[layout.dtype]
    )
    canonical = options.format == "canonical"
    if canonical:
        refuse_compression("KVDI_S3", options.compression, compressor)
    grid = (options.section_layers, options.section_heads)
    size = canonical_object_bytes(layout, grid, "KVDI_S3") if canonical else HEADER_SIZE + layout.block_bytes
    store = S3BlockStore(options, max_object_bytes=size + FRAME_ROOM)
    store.compressor = compressor
    return CanonicalBlockStore(store, layout, frame_key(settings), grid) if canonical else store


__all__ = ["FRAME_ROOM", "S3BlockStore", "S3Settings", "open_store"]
