"""The ``shared_storage`` backend factory: :func:`open_store` builds a :class:`~.store.FileBlockStore` from settings.

With ``format=canonical`` the store publishes each section once (``publish_once``: a section file already
there, whole and private, is not written again, as on S3); per-rank frames are rewritten as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvdi.connectors.shared_storage.safe_dir import vet_root
from kvdi.connectors.shared_storage.store import FileBlockStore
from kvdi.connectors.store.canonical_store import CanonicalBlockStore, canonical_object_bytes
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.integrity import frame_key
from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import KvdiSettings, SharedStorageSettings


def open_store(
    options: SharedStorageSettings, layout: KVCacheSpec, settings: KvdiSettings
) -> FileBlockStore | CanonicalBlockStore:
    """The backend factory named by the ``shared_storage`` spec: creates the directory if needed. With
    ``format="canonical"`` the files are canonical sections behind :class:`CanonicalBlockStore`."""
    key = frame_key(settings)  # a bad integrity key is a ConfigError when the backend is built (and in `kvdi check`)
    root = Path(options.path).expanduser()
    vet_root(root, options.mode)  # others may not write; a world-writable root is worth a warning
    canonical = options.format == "canonical"
    grid = (options.section_layers, options.section_heads)
    size = None if canonical else HEADER_SIZE + layout.block_bytes  # canonical packs: of several sizes
    if canonical:
        canonical_object_bytes(layout, grid)  # a grid that does not divide: one line, now
    store = FileBlockStore(root, options.max_bytes, mode=options.mode, object_bytes=size, publish_once=canonical)
    try:
        store.open()  # now: a bad path is a ConfigError at build time, not a miss per call
    except OSError as exc:
        store.close()
        why = exc.strerror or str(exc)
        if os.path.islink(root):
            why = f"it is a symlink; point it at the real directory ({os.path.realpath(root)!r})"
        raise ConfigError(
            f"KVDI_SHARED_STORAGE__PATH={str(root)!r}: cannot use it as the KV store directory ({why}); "
            f"point it at a writable directory"
        ) from None
    return CanonicalBlockStore(store, layout, key, grid) if canonical else store


__all__ = ["open_store"]
