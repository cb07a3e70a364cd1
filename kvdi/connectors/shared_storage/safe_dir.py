"""A store root and its fan-out folders, opened once with ``O_DIRECTORY | O_NOFOLLOW``.

Callers do every file operation relative to the descriptors handed out here (``dir_fd=``),
so no symlink planted under the root is ever followed: a symlink (or a file) squatting on a
fan-out folder's name is a miss on reads and is replaced by a real folder on writes. Paths
above the root are the operator's choice and resolve normally; the root itself must not be a
symlink. Descriptors are cached (one per folder, opened once, not per call) until :meth:`close`.

Before a write, a cached fan-out folder is checked to still be the folder of that name under
the root (device and inode): one moved out of the store (or replaced) while an engine runs is
never written to again; the name is opened (or created) afresh. :func:`vet_root` refuses a
mode that lets others write and warns about an existing world-writable root.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Literal, overload

from kvdi.errors import ConfigError

logger = logging.getLogger(__name__)

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


class SafeDir:
    """The descriptors of ``root`` and its sub-folders; thread-safe; ``mode`` for folders it creates."""

    def __init__(self, root: Path, mode: int) -> None:
        self.root = root
        self.mode = mode
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._subs: dict[str, int] = {}
        self._ids: dict[str, tuple[int, int]] = {}  # (st_dev, st_ino) of each cached folder
        self._retired: list[int] = []  # dropped from the cache, closed only by close(): a thread may still use one
        self._closed = False

    def open(self) -> int:
        """The root's descriptor, creating (``mode``) and opening the root on first use; OSError when impossible."""
        fd = self._fd
        if fd is not None:
            return fd
        if self._closed:
            raise OSError(errno.EBADF, "the store is closed")
        with contextlib.suppress(FileExistsError):
            os.makedirs(self.root, self.mode)
        fd = os.open(self.root, DIR_FLAGS)
        with self._lock:
            if self._fd is None and not self._closed:
                self._fd = fd
                return fd
        os.close(fd)
        return self.open()

    @overload
    def sub(self, name: str, create: Literal[True]) -> int: ...
    @overload
    def sub(self, name: str, create: bool) -> int | None: ...

    def sub(self, name: str, create: bool) -> int | None:
        """Folder ``name``'s descriptor; None when it is absent or no real folder and ``create`` is false."""
        fd = self._subs.get(name)
        if fd is not None:
            if not create or self._still_inside(name, fd):
                return fd
            self._forget(name)
        root = self.open()
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=root)
        except OSError as exc:
            if not create:
                if exc.errno in _ABSENT:
                    return None
                raise
            if exc.errno != errno.ENOENT:  # a symlink or a file squats on the folder's name
                os.unlink(name, dir_fd=root)
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, self.mode, dir_fd=root)
            fd = os.open(name, DIR_FLAGS, dir_fd=root)
        st = os.fstat(fd)
        with self._lock:
            cached = self._subs.setdefault(name, fd) if not self._closed else -1
            if cached == fd:
                self._ids[name] = (st.st_dev, st.st_ino)
        if cached != fd:
            os.close(fd)  # another thread opened it first, or the store closed meanwhile
            if cached == -1:
                raise OSError(errno.EBADF, "the store is closed")
        return cached

    def _still_inside(self, name: str, fd: int) -> bool:
        """Whether ``name`` under the root is still the folder ``fd`` was opened on (not moved, not replaced)."""
        try:
            st = os.stat(name, dir_fd=self.open(), follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and self._ids.get(name) == (st.st_dev, st.st_ino)

    def _forget(self, name: str) -> None:
        """A cached folder is not under the root any more (moved out, replaced, or the root itself removed):
        forget every descriptor, so the root and the folder are opened (or created) afresh."""
        logger.warning(
            "store %s: the folder %r is no longer the one under the store (moved, replaced or removed); "
            "reopening, never writing there",
            self.root,
            name,
        )
        self.reset()

    def reset(self) -> None:
        """Forget every cached descriptor (the tree was removed or replaced under us); the next call reopens.

        The old descriptors stay open until :meth:`close`: closing one that another thread is
        using could let the number be reused for an unrelated file.
        """
        with self._lock:
            self._retired += self._subs.values()
            self._subs = {}
            self._ids = {}
            if self._fd is not None:
                self._retired.append(self._fd)
                self._fd = None

    def close(self) -> None:
        """Close every descriptor; later calls raise OSError (EBADF)."""
        with self._lock:
            self._closed = True
            fds, self._subs, self._retired = [*self._subs.values(), *self._retired], {}, []
            if self._fd is not None:
                fds.append(self._fd)
                self._fd = None
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def vet_root(root: Path, file_mode: int, variable: str = "KVDI_SHARED_STORAGE__MODE") -> None:
    """Refuse a file mode that lets others write (ConfigError naming ``variable``); warn when ``root``
    exists and anyone may write into it (anyone could then plant, replace or remove objects)."""
    if file_mode & 0o002:
        raise ConfigError(
            f"{variable}={file_mode:04o}: lets every user of this host write the KV store (and so feed KV to "
            "the engine); use 0600 (private), 0640 or 0660 (a group, see docs/security.md)"
        )
    try:
        st = os.stat(root, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002:
        logger.warning(
            "KV store %s is world-writable (mode %04o): anyone on this host can plant, replace or remove "
            "objects; chmod o-w it, or set KVDI_INTEGRITY_KEY so planted objects are misses",
            root,
            stat.S_IMODE(st.st_mode),
        )


__all__ = ["DIR_FLAGS", "SafeDir", "vet_root"]
