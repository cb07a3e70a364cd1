"""The ``shared_storage`` store: :class:`FileBlockStore` and its backend factory (see the package docstring)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from kvdi.connectors.logging_once import log_once
from kvdi.connectors.shared_storage.fileio import advance, link_fd, list_entries, readv_full, writev_full
from kvdi.connectors.shared_storage.safe_dir import SafeDir
from kvdi.connectors.store.framing import Buffer

logger = logging.getLogger(__name__)

LOW_WATERMARK = 0.9  # evict down to this fraction of max_bytes
STALE_TEMP_S = 3600.0  # temp files older than this belong to dead writers
DEFAULT_MODE = 0o600

# O_NONBLOCK: a FIFO squatting on the name must not hang the engine (no-op for files).
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# O_TMPFILE (Linux): an anonymous file in the folder, linked into place once written.
_ANON_FLAGS = os.O_WRONLY | getattr(os, "O_TMPFILE", 0) | os.O_CLOEXEC
_NO_TMPFILE = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOSYS)
_ABSENT = (errno.ENOENT, errno.ENOTDIR)
_NOT_A_FILE = (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP, errno.ENODEV)
_BACKEND_ERRORS = (OSError, ValueError, OverflowError, MemoryError)

_R = TypeVar("_R")


def dir_mode(mode: int) -> int:
    """The folder mode for a file ``mode``: x added wherever r is set (0600 -> 0700, 0640 -> 0750)."""
    return mode | ((mode & 0o444) >> 2)


class FileBlockStore:
    """A :class:`~kvdi.connectors.store.BlockStore` over a directory; safe across threads and processes.

    ``object_bytes``: the one valid object size (a frame); objects of any other size are never
    read (a miss the reader drops). ``mode``: file mode of new objects. ``publish_once``: an object already
    stored whole (a regular file of the size written, no mode wider than ``mode``) is not written again (S3's
    conditional create); anything else under its name is replaced, as every write replaces without it.
    ``root`` is created (mode 0700 for 0600 files) and opened on first use; while it cannot be opened as a
    real directory (a symlink is refused), every call is a miss or a failed write, never an exception.
    """

    hit_source = "disk"  # the tier vLLM's external_prefix_cache_hits names (vllm CacheHitSource)

    def __init__(
        self,
        root: Path,
        max_bytes: int | None = None,
        *,
        mode: int = DEFAULT_MODE,
        object_bytes: int | None = None,
        publish_once: bool = False,
    ) -> None:
        self.root = root
        self.publish_once = publish_once
        self.max_bytes = max_bytes
        self.mode = mode
        self.object_bytes = object_bytes
        self._dirs = SafeDir(root, dir_mode(mode))
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._approx_bytes = 0
        self._evicted: Callable[[bytes], None] | None = None  # the eviction watcher (KV cache events)
        self._anonymous = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")
        if max_bytes:
            with contextlib.suppress(OSError):
                self._approx_bytes = self.scan()[1]

    def watch_evictions(self, evicted: Callable[[bytes], None]) -> None:
        """:class:`~kvdi.connectors.store.EvictingStore`: ``evicted(key)`` for each object the size cap removes."""
        self._evicted = evicted

    @property
    def stored_bytes(self) -> int | None:
        """Bytes in the folder as last measured (a scan at start and at each eviction, plus this process's writes);
        None without a size cap (nothing is measured then). For ``vllm:kvdi_store_bytes``."""
        return self._approx_bytes if self.max_bytes else None

    def path_for(self, key: bytes) -> Path:
        """Where the object of ``key`` lives."""
        name = key.hex()
        return self.root / name[:2] / name

    def _log_once(self, what: str, message: str, *args: object) -> None:
        log_once(
            logger, self._logged, what, "shared_storage %s: " + message + " (at most once a minute)", self.root, *args
        )

    # -- reads ---------------------------------------------------------------------------------

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """Leading keys with something under their name (an odd entry counts: loading it drops it)."""
        for n, key in enumerate(keys):
            name = key.hex()
            try:
                sub = self._dirs.sub(name[:2], create=False)
                if sub is None:
                    return n
                os.stat(name, dir_fd=sub, follow_symlinks=False)
            except _BACKEND_ERRORS:
                return n
        return len(keys)

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        def read(_i: int, fd: int, size: int) -> Buffer:
            buf = bytearray(size)
            got = readv_full(fd, [memoryview(buf)])
            return buf if got == size else memoryview(buf)[:got]

        not_an_object: Buffer = b""  # present but not an object: the reader drops it
        return self._read_objects(keys, read, not_an_object)

    def get_into_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        """Read each object straight into its pieces when its size matches (see ``ReadIntoStore``)."""

        def read(i: int, fd: int, size: int) -> int:
            pieces = items[i][1]
            return readv_full(fd, pieces) if size == sum(p.nbytes for p in pieces) else size

        return self._read_objects([key for key, _ in items], read, 0)

    def get_range_into_many(self, items: Sequence[tuple[bytes, int, Sequence[memoryview]]]) -> list[int | None]:
        """Bytes from an offset into pieces (``preadv``, a pack's sections) when the object holds them: its size."""

        def read(i: int, fd: int, size: int) -> int:
            _, at, pieces = items[i]
            bufs, want = list(pieces), sum(p.nbytes for p in pieces)
            if at + want <= size:
                while want and (n := os.preadv(fd, bufs, at)):
                    at, want = at + n, want - n
                    if want:  # a short read (rare): go on after it
                        advance(bufs, n)
            return size

        return self._read_objects([key for key, _, _ in items], read, 0)

    def _read_objects(
        self, keys: Sequence[bytes], read: Callable[[int, int, int], _R], not_object: _R
    ) -> list[_R | None]:
        """``read(i, fd, size)`` each key's object: None where absent or unreadable, ``not_object`` where odd.

        Never raises: every failure is a miss of that one object.
        """
        out: list[_R | None] = []
        stamp = time.time_ns()
        for i, key in enumerate(keys):
            try:
                fd = self._open(key)
            except OSError as exc:
                odd = exc.errno in _NOT_A_FILE
                if not odd:
                    self._log_once(f"read:{exc.errno}", "cannot open an object, treating it as a miss: %s", exc)
                out.append(not_object if odd else None)
                continue
            if fd is None:
                out.append(None)
                continue
            try:
                st = os.fstat(fd)
                size = st.st_size
                if not stat.S_ISREG(st.st_mode) or (self.object_bytes and size != self.object_bytes):
                    out.append(not_object)  # never read more than one frame of anything
                    continue
                out.append(read(i, fd, size))
                self._touch(fd, stamp + len(keys) - i)
            except _BACKEND_ERRORS as exc:
                self._log_once(f"read:{type(exc).__name__}", "reading an object failed, treating it as a miss: %s", exc)
                out.append(None)
            finally:
                os.close(fd)
        return out

    def prefetch(self, keys: Sequence[bytes]) -> bool:
        """Ask the kernel to read ``keys``' files ahead (``POSIX_FADV_WILLNEED``), so several are in flight.

        A non-blocking read of the first object's last byte (``RWF_NOWAIT``) probes the page cache:
        when it is there, the objects are taken as warm and nothing is done (False). Never raises.
        """
        if not keys or self.object_bytes is None or not hasattr(os, "RWF_NOWAIT"):
            return False
        probe = memoryview(bytearray(1))
        for n, key in enumerate(keys):
            try:
                fd = self._open(key)
            except OSError:
                continue
            if fd is None:
                continue
            try:
                if n == 0:
                    try:
                        if os.preadv(fd, [probe], self.object_bytes - 1, os.RWF_NOWAIT) == 1:
                            return False  # in the page cache: warm
                    except BlockingIOError:
                        pass  # not cached: read ahead
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.posix_fadvise(fd, 0, self.object_bytes, os.POSIX_FADV_WILLNEED)
            except OSError:
                continue
            finally:
                os.close(fd)
        return True

    def _open(self, key: bytes) -> int | None:
        name = key.hex()
        sub = self._dirs.sub(name[:2], create=False)
        if sub is None:
            return None
        try:
            return os.open(name, _READ_FLAGS, dir_fd=sub)
        except OSError as exc:
            if exc.errno in _ABSENT:
                return None
            raise

    def _touch(self, fd: int, stamp: int) -> None:
        if self.max_bytes:
            with contextlib.suppress(OSError):  # best effort: a read-only store still serves reads
                os.utime(fd, ns=(stamp, stamp))

    # -- writes --------------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> int:
        """Publish each object atomically; returns how many were written (failures are logged once, not raised)."""
        written = count = 0
        stamp = time.time_ns()
        for i, (key, pieces) in enumerate(items):
            try:
                written += self._put(key, pieces, stamp + len(items) - i)
                count += 1
            except _BACKEND_ERRORS as exc:
                self._log_once(f"write:{type(exc).__name__}", "writing an object failed: %s", exc)
        if self.max_bytes and written:
            with self._lock:
                self._approx_bytes += written
                over = self._approx_bytes > self.max_bytes
            if over:
                self.evict()
        return count

    def _put(self, key: bytes, pieces: Sequence[Buffer], stamp: int) -> int:
        name = key.hex()
        try:
            return self._write(self._dirs.sub(name[:2], create=True), name, pieces, stamp)
        except FileNotFoundError:  # the store was removed under us (e.g. rm -rf to clear it): reopen, once
            self._dirs.reset()
            return self._write(self._dirs.sub(name[:2], create=True), name, pieces, stamp)

    def _held(self, sub: int, name: str, stamp: int, size: int) -> bool:
        """``publish_once``: whether ``name`` is already a whole object (a regular file of the ``size`` written, no
        mode wider than ours): then it is kept (its mtime refreshed under a size cap) and not written again."""
        try:
            st = os.stat(name, dir_fd=sub, follow_symlinks=False)
        except OSError:
            return False
        held = stat.S_ISREG(st.st_mode) and st.st_size == size and not st.st_mode & 0o7777 & ~self.mode
        if held and self.max_bytes:
            with contextlib.suppress(OSError):  # best effort, as a read's touch
                os.utime(name, ns=(stamp, stamp), dir_fd=sub, follow_symlinks=False)
        return held

    def _write(self, sub: int, name: str, pieces: Sequence[Buffer], stamp: int) -> int:
        total = sum(memoryview(p).nbytes for p in pieces)
        if self.publish_once and self._held(sub, name, stamp, total):
            return 0
        fd, tmp = self._create(sub, name)
        try:
            try:
                size = writev_full(fd, pieces, total)
                if self.max_bytes:
                    os.utime(fd, ns=(stamp, stamp))
                if tmp is None:  # an anonymous file: give it its name (or a temp name, then rename over)
                    tmp = link_fd(fd, sub, name)
            finally:
                os.close(fd)
            if tmp is not None:
                os.replace(tmp, name, src_dir_fd=sub, dst_dir_fd=sub)
        except BaseException:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=sub)
            raise
        return size

    def _create(self, sub: int, name: str) -> tuple[int, str | None]:
        """A new file for ``name``: anonymous (``O_TMPFILE``: no temp name, no rename, gone if the writer dies)
        where the file system can, else a named temp file (``O_EXCL``), returned with its name."""
        if self._anonymous:
            try:
                return os.open(".", _ANON_FLAGS, self.mode, dir_fd=sub), None
            except OSError as exc:
                if os.fstat(sub).st_nlink == 0:  # the folder was removed (Linux answers EPERM here)
                    raise FileNotFoundError(errno.ENOENT, "the store folder was removed") from exc
                if exc.errno not in _NO_TMPFILE:
                    raise
                self._anonymous = False  # this file system cannot: named temp files from now on
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        return os.open(tmp, _TEMP_FLAGS, self.mode, dir_fd=sub), tmp

    def discard(self, key: bytes) -> None:
        """Remove whatever sits under ``key``'s name (a squatting folder too, without following links)."""
        name = key.hex()
        sub = self._dirs.sub(name[:2], create=False)
        if sub is None:
            return
        try:
            if stat.S_ISDIR(os.stat(name, dir_fd=sub, follow_symlinks=False).st_mode):
                # fd-based rmtree (3.11+) never follows a link; on 3.10 a squatting folder stays and
                # every read of it is a counted miss.
                if sys.version_info >= (3, 11):
                    shutil.rmtree(name, dir_fd=sub, ignore_errors=True)
            else:
                os.unlink(name, dir_fd=sub)
        except OSError as exc:
            if exc.errno not in _ABSENT:
                raise

    # -- size cap ------------------------------------------------------------------------------

    def scan(self) -> tuple[list[tuple[int, int, int, str]], int]:
        """Every object as ``(mtime_ns, size, folder_fd, name)`` and their total size; removes stale temp files."""
        objects: list[tuple[int, int, int, str]] = []
        total = 0
        stale_before = time.time_ns() - int(STALE_TEMP_S * 1e9)
        prefixes = [n for n, st in list_entries(self._dirs.open()) if len(n) == 2 and stat.S_ISDIR(st.st_mode)]
        for prefix in prefixes:
            sub = self._dirs.sub(prefix, create=False)
            if sub is None:
                continue
            for name, st in list_entries(sub):
                if name.startswith("."):
                    if st.st_mtime_ns < stale_before:
                        with contextlib.suppress(OSError):
                            os.unlink(name, dir_fd=sub)
                elif stat.S_ISREG(st.st_mode):
                    objects.append((st.st_mtime_ns, st.st_size, sub, name))
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
                for _mtime, size, sub, name in sorted(objects):
                    if total - freed <= target:
                        break
                    try:
                        os.unlink(name, dir_fd=sub)
                    except FileNotFoundError:
                        continue  # another process evicted it
                    except OSError:
                        break  # read-only store: nothing more to do
                    freed += size
                    if self._evicted is not None and len(name) == 32:
                        with contextlib.suppress(ValueError):
                            self._evicted(bytes.fromhex(name))
            self._approx_bytes = total - freed
            return freed

    def check(self) -> str:
        """``kvdi check``: open the folder and write, read and remove one object; OSError if it cannot serve."""
        root = self._dirs.open()
        probe = f".kvdi-check.{secrets.token_hex(8)}"
        fd = os.open(probe, _TEMP_FLAGS, self.mode, dir_fd=root)
        os.close(fd)
        os.unlink(probe, dir_fd=root)
        cap = f", cap {self.max_bytes} B" if self.max_bytes else ""
        return f"shared_storage: {self.root} writable, files {self.mode:04o}, folders {self._dirs.mode:04o}{cap}"

    def open(self) -> None:
        """Create and open the root now (otherwise on first use); OSError when it is no real directory."""
        self._dirs.open()

    def close(self) -> None:
        """Close the folder descriptors; the store must not be used afterwards."""
        self._dirs.close()


__all__ = ["DEFAULT_MODE", "FileBlockStore", "dir_mode"]
