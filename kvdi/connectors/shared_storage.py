"""The ``shared_storage`` backend: framed KV objects in a local directory (the embedded default).

Each object is one file named by its key in hex, under a two-character fan-out directory
(``<root>/ab/ab12...``); names are derived from hashes only. Writers write a temporary file
in the same directory and publish it with ``os.replace``, so readers (other threads, other
processes, other engines sharing the directory) see a whole object or none, and concurrent
writers of one key are safe (the last rename wins; both wrote the same bytes). Nothing is
indexed in memory only, so the store survives restarts.

With ``max_bytes`` set, the store evicts least-recently-used objects (by mtime; reads touch
it) once it grows past the cap, down to 90 % of it. Within one batch of blocks (a chain of
one request, saved or loaded together) the head gets the newest mtime and the tail the
oldest, so eviction drops chains tail first and a surviving head stays loadable.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import KvdiSettings, SharedStorageSettings

Buffer = bytes | bytearray | memoryview

LOW_WATERMARK = 0.9  # evict down to this fraction of max_bytes
STALE_TEMP_S = 3600.0  # temp files older than this belong to dead writers

_R = TypeVar("_R")


class FileBlockStore:
    """A :class:`~kvdi.connectors.store.BlockStore` over a directory; safe across threads and processes."""

    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        self.root = root
        self._root = os.fspath(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._approx_bytes = self.scan()[1] if max_bytes else 0

    def path_for(self, key: bytes) -> Path:
        """Where the object of ``key`` lives."""
        return Path(self._path(key))

    def _path(self, key: bytes) -> str:
        name = key.hex()  # hash-derived names only: nothing a prompt controls reaches the filesystem
        return f"{self._root}/{name[:2]}/{name}"

    # -- reads ---------------------------------------------------------------------------------

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        for n, key in enumerate(keys):
            try:
                os.stat(self._path(key))
            except (FileNotFoundError, NotADirectoryError):
                return n
        return len(keys)

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        def read(_i: int, fd: int, size: int) -> Buffer:
            buf = bytearray(size)
            got = _readv_full(fd, [memoryview(buf)])
            return buf if got == size else memoryview(buf)[:got]

        not_an_object: Buffer = b""  # present but not an object: the reader drops it
        return self._read_objects(keys, read, not_an_object)

    def get_into_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        """Read each object straight into its pieces when its size matches (see ``ReadIntoStore``)."""

        def read(i: int, fd: int, size: int) -> int:
            pieces = items[i][1]
            return _readv_full(fd, pieces) if size == sum(p.nbytes for p in pieces) else size

        return self._read_objects([key for key, _ in items], read, 0)

    def _read_objects(
        self, keys: Sequence[bytes], read: Callable[[int, int, int], _R], not_object: _R
    ) -> list[_R | None]:
        """``read(i, fd, size)`` each key's object: None where absent, ``not_object`` where the name is no file."""
        out: list[_R | None] = []
        stamp = time.time_ns()
        for i, key in enumerate(keys):
            fd = self._open(key)
            if fd is None:
                out.append(None)
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    out.append(not_object)
                    continue
                out.append(read(i, fd, st.st_size))
                self._touch(fd, stamp + len(keys) - i)
            finally:
                os.close(fd)
        return out

    def _open(self, key: bytes) -> int | None:
        try:
            # O_NONBLOCK: a FIFO squatting on the name must not hang the engine (no-op for files).
            return os.open(self._path(key), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _touch(self, fd: int, stamp: int) -> None:
        if self.max_bytes:
            with contextlib.suppress(OSError):  # best effort: a read-only store still serves reads
                os.utime(fd, ns=(stamp, stamp))

    # -- writes --------------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> None:
        """Publish each object atomically; every item is tried, then the first OSError is raised."""
        first_error: OSError | None = None
        written = 0
        stamp = time.time_ns()
        for i, (key, pieces) in enumerate(items):
            try:
                written += self._put(key, pieces, stamp + len(items) - i)
            except OSError as exc:
                first_error = first_error or exc
        if self.max_bytes and written:
            with self._lock:
                self._approx_bytes += written
                over = self._approx_bytes > self.max_bytes
            if over:
                self.evict()
        if first_error is not None:
            raise first_error

    def _put(self, key: bytes, pieces: Sequence[Buffer], stamp: int) -> int:
        path = self._path(key)
        parent, _, name = path.rpartition("/")
        tmp = f"{parent}/.{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:
            os.makedirs(parent, exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        try:
            try:
                size = _writev_full(fd, pieces)
                if self.max_bytes:
                    os.utime(fd, ns=(stamp, stamp))
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return size

    def discard(self, key: bytes) -> None:
        path = self._path(key)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)  # something else squats on the object's name
            else:
                os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            return

    # -- size cap ------------------------------------------------------------------------------

    def scan(self) -> tuple[list[tuple[int, int, str]], int]:
        """Every object as ``(mtime_ns, size, path)`` and their total size; removes stale temp files."""
        objects: list[tuple[int, int, str]] = []
        total = 0
        stale_before = time.time_ns() - int(STALE_TEMP_S * 1e9)
        try:
            subdirs = [e for e in os.scandir(self.root) if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return objects, 0
        for sub in subdirs:
            with contextlib.suppress(FileNotFoundError), os.scandir(sub.path) as entries:
                for entry in entries:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if entry.name.startswith("."):
                        if st.st_mtime_ns < stale_before:
                            with contextlib.suppress(OSError):
                                os.unlink(entry.path)
                        continue
                    if stat.S_ISREG(st.st_mode):
                        objects.append((st.st_mtime_ns, st.st_size, entry.path))
                        total += st.st_size
        return objects, total

    def evict(self) -> int:
        """If over ``max_bytes``, remove least-recently-used objects down to the low watermark; bytes freed."""
        if not self.max_bytes:
            return 0
        with self._lock:
            objects, total = self.scan()
            freed = 0
            if total > self.max_bytes:
                target = int(self.max_bytes * LOW_WATERMARK)
                for _mtime, size, path in sorted(objects):
                    if total - freed <= target:
                        break
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        continue  # another process evicted it
                    except OSError:
                        break  # read-only store: nothing more to do
                    freed += size
            self._approx_bytes = total - freed
            return freed

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own files."""


def _advance(bufs: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from ``bufs`` after a short vectored read or write."""
    while bufs and n >= bufs[0].nbytes:
        n -= bufs.pop(0).nbytes
    if n:
        bufs[0] = bufs[0][n:]


def _readv_full(fd: int, pieces: Sequence[memoryview]) -> int:
    """Fill ``pieces`` from ``fd``; returns bytes read (less than asked only at end of file)."""
    bufs = [p for p in pieces if p.nbytes]
    done = 0
    while bufs:
        n = os.readv(fd, bufs)
        if n == 0:
            break
        done += n
        _advance(bufs, n)
    return done


def _writev_full(fd: int, pieces: Sequence[Buffer]) -> int:
    """Write all ``pieces`` to ``fd`` (retrying short writes); returns bytes written."""
    bufs = [v for v in (memoryview(p).cast("B") for p in pieces) if v.nbytes]
    done = 0
    while bufs:
        n = os.writev(fd, bufs)
        done += n
        _advance(bufs, n)
    return done


def open_store(options: SharedStorageSettings, layout: KVCacheSpec, settings: KvdiSettings) -> FileBlockStore:
    """The backend factory named by the ``shared_storage`` spec: creates the directory if needed."""
    root = Path(options.path).expanduser()
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"KVDI_SHARED_STORAGE__PATH={str(root)!r}: cannot create the KV store directory "
            f"({exc.strerror or exc}); point it at a writable directory"
        ) from None
    return FileBlockStore(root, options.max_bytes)


__all__ = ["FileBlockStore", "open_store"]
