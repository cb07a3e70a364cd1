"""Administration of a ``shared_storage`` folder: list, read, remove objects without following a symlink.

The folder is as hostile here as it is to the engine: the root is opened ``O_DIRECTORY |
O_NOFOLLOW``, fan-out folders through the root's descriptor, objects through their folder's
descriptor with ``O_NOFOLLOW | O_NONBLOCK``. An entry under an object's name that is no
regular file (a symlink, a FIFO, a folder) is listed as odd: kvdi never writes one, so it is
foreign (reported, never removed, never followed). Objects are read with ``pread`` at most the
bytes asked (a header, then one frame's payload in chunks), whatever size the file claims.
Writers' temp files (dot names) and anything else are counted as other entries and left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvdi.admin.model import StoreObject, is_hex, is_key_name
from kvdi.connectors.shared_storage.safe_dir import DIR_FLAGS

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "folder"
    return "not a file"


class FileStoreAdmin:
    """A :class:`~kvdi.admin.model.StoreAdmin` over a shared_storage root (which must exist and be no symlink)."""

    kind = "shared_storage"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.where = str(root)
        self._fd = os.open(root, DIR_FLAGS)  # OSError when absent, a symlink or no folder
        self._other = 0

    def _entries(self, dir_fd: int) -> list[tuple[str, os.stat_result]]:
        fd = os.open(".", DIR_FLAGS, dir_fd=dir_fd)
        out: list[tuple[str, os.stat_result]] = []
        with os.scandir(fd) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError):
                    out.append((entry.name, entry.stat(follow_symlinks=False)))
        os.close(fd)
        return out

    def objects(self) -> Iterator[StoreObject]:
        self._other = 0
        for prefix, st in sorted(self._entries(self._fd)):
            if not (len(prefix) == 2 and stat.S_ISDIR(st.st_mode) and is_hex(prefix)):
                self._other += 1
                continue
            try:
                sub = os.open(prefix, DIR_FLAGS, dir_fd=self._fd)
            except OSError:
                self._other += 1
                continue
            try:
                for name, est in self._entries(sub):
                    if not (is_key_name(name) and name.startswith(prefix)):
                        self._other += 1
                        continue
                    odd = None if stat.S_ISREG(est.st_mode) else _kind(est.st_mode)
                    yield StoreObject(name, prefix, est.st_size, est.st_mtime_ns / 1e9, ref=(prefix, name), odd=odd)
            finally:
                os.close(sub)

    def other_entries(self) -> int:
        """Entries seen by the last full listing that are no objects (temp files, foreign names)."""
        return self._other

    def _sub(self, prefix: str) -> int | None:
        try:
            return os.open(prefix, DIR_FLAGS, dir_fd=self._fd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None
            raise

    def read_many(self, objs: Sequence[StoreObject], offset: int, length: int) -> list[bytes | None]:
        return [self._read(obj, offset, length) for obj in objs]

    def _read(self, obj: StoreObject, offset: int, length: int) -> bytes | None:
        """At most ``length`` bytes of ``obj`` from ``offset`` (``pread``: never more, whatever the file's size)."""
        prefix, name = obj.ref
        sub = self._sub(prefix)
        if sub is None:
            return None
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=sub)
        except FileNotFoundError:
            return None
        except OSError:  # a symlink or a FIFO put there since the listing: no frame
            return b""
        finally:
            os.close(sub)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return b""
            chunks: list[bytes] = []
            got = 0
            while got < length:
                chunk = os.pread(fd, length - got, offset + got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def remove(self, obj: StoreObject) -> bool:
        """Unlink one regular file (only ever asked for an object whose content is a kvdi frame)."""
        prefix, name = obj.ref
        if obj.odd is not None:  # a folder, a symlink, a FIFO under an object's name: never kvdi's, never removed
            return False
        sub = self._sub(prefix)
        if sub is None:
            return False
        try:
            os.unlink(name, dir_fd=sub)
            return True
        except FileNotFoundError:
            return False
        finally:
            os.close(sub)

    def server_info(self) -> dict[str, Any]:
        """The store folder's permission bits, in octal as ``chmod`` takes them (e.g. ``0o700``)."""
        return {"folder_mode": oct(stat.S_IMODE(os.fstat(self._fd).st_mode))}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


__all__ = ["FileStoreAdmin"]
