"""Vectored file I/O for file-backed stores: whole reads and writes over several buffers, folder listings.

Short reads and writes are retried from where they stopped; nothing here follows a symlink
(listings go through a descriptor of the folder, entries are ``lstat``-ed).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence

from kvdi.connectors.shared_storage.safe_dir import DIR_FLAGS
from kvdi.connectors.store.framing import Buffer


def list_entries(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    """Names and lstat results of a folder's entries, listed through a descriptor of its own (own offset)."""
    fd = os.open(".", DIR_FLAGS, dir_fd=dir_fd)
    out: list[tuple[str, os.stat_result]] = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                with contextlib.suppress(FileNotFoundError):
                    out.append((entry.name, entry.stat(follow_symlinks=False)))
    finally:
        os.close(fd)
    return out


def advance(bufs: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from ``bufs`` after a short vectored read or write."""
    while bufs and n >= bufs[0].nbytes:
        n -= bufs.pop(0).nbytes
    if n:
        bufs[0] = bufs[0][n:]


def readv_full(fd: int, pieces: Sequence[memoryview]) -> int:
    """Fill ``pieces`` from ``fd``; returns bytes read (less than asked only at end of file)."""
    bufs = [p for p in pieces if p.nbytes]
    done = 0
    while bufs:
        n = os.readv(fd, bufs)
        if n == 0:
            break
        done += n
        advance(bufs, n)
    return done


def writev_full(fd: int, pieces: Sequence[Buffer], total: int | None = None) -> int:
    """Write all ``pieces`` to ``fd`` (retrying short writes); returns bytes written. With ``total`` (their bytes,
    known to the caller) the first ``writev`` takes the pieces as they are, and they are viewed as bytes only
    after a short write (a pack's many pieces: no view made per piece on the usual path)."""
    done = 0
    if total is not None:
        done = os.writev(fd, pieces)
        if done == total:
            return done
    bufs = [v for v in (memoryview(p).cast("B") for p in pieces) if v.nbytes]
    advance(bufs, done)
    while bufs:
        n = os.writev(fd, bufs)
        done += n
        advance(bufs, n)
    return done


def link_fd(fd: int, dir_fd: int, name: str) -> str | None:
    """Publish the anonymous file ``fd`` (``O_TMPFILE``) as ``name`` in ``dir_fd``, atomically (whole or absent).

    ``link`` never replaces: when ``name`` exists the file is linked under a temp name instead, which
    is returned for the caller to rename over ``name`` (and remove on failure); None otherwise.
    """
    proc = f"/proc/self/fd/{fd}"  # our own descriptor: the only link followed, and not under a store root
    try:
        os.link(proc, name, dst_dir_fd=dir_fd, follow_symlinks=True)
        return None
    except FileExistsError:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        os.link(proc, tmp, dst_dir_fd=dir_fd, follow_symlinks=True)
        return tmp


__all__ = ["advance", "link_fd", "list_entries", "readv_full", "writev_full"]
