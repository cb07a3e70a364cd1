"""The ``shared_storage`` backend: framed KV objects in a local directory (the embedded default).

Each object is one file named by its key in hex, under a two-character fan-out directory
(``<root>/ab/ab12...``); names are derived from hashes only. Writers write an anonymous file
(``O_TMPFILE``) in the same directory and publish it with ``link`` (or, where the file system
lacks ``O_TMPFILE``, a temporary file with a random name, ``O_EXCL``, published with
``os.replace``), so readers (other threads, other processes, other engines sharing the
directory) see a whole object or none, and concurrent writers of one key are safe (the last
rename wins; both wrote the same bytes). With ``publish_once`` (canonical sections) an object
already there, a regular file of the object size and no wider mode, is not written again (its
mtime refreshed under a size cap), as S3's conditional create; anything else under the name is
replaced. A bad section of the right size is discarded by its reader and written again by the
next save. Nothing is indexed in memory only, so the store survives restarts.

The store directory is hostile input. The root and the fan-out folders are opened once with
``O_DIRECTORY | O_NOFOLLOW`` and every file operation is relative to those descriptors, so no
symlink under the root is ever followed (a planted one is replaced by a real folder on the next
write); objects are opened with ``O_NOFOLLOW | O_NONBLOCK`` and read only when their size is
exactly one frame, so a socket, FIFO, symlink, directory or huge file in an object's place is
a miss (dropped by the reader) that costs no more than one frame of memory. Files are created
with ``mode`` (0600 by default) and folders with x added where r is set (0700).

With ``max_bytes`` set, the store evicts least-recently-used objects (by mtime; reads touch
it) once it grows past the cap, down to 90 % of it. Within one batch of blocks (a chain of
one request, saved or loaded together) the head gets the newest mtime and the tail the
oldest, so eviction drops chains tail first and a surviving head stays loadable.

The package holds the store and its helpers: :mod:`.store` (:class:`FileBlockStore`),
:mod:`.factory` (:func:`open_store`), :mod:`.safe_dir` (a root opened once, no symlink followed) and
:mod:`.fileio` (vectored whole reads and writes, publishing by ``link``).
"""

from __future__ import annotations

from kvdi.connectors.shared_storage.factory import open_store
from kvdi.connectors.shared_storage.store import (
    DEFAULT_MODE,
    LOW_WATERMARK,
    STALE_TEMP_S,
    FileBlockStore,
    dir_mode,
)

__all__ = ["DEFAULT_MODE", "LOW_WATERMARK", "STALE_TEMP_S", "FileBlockStore", "dir_mode", "open_store"]
