"""What every store administration backend offers, and the three operations over it (stats, verify, clear).

A backend (:class:`StoreAdmin`) lists the objects of one store (:class:`StoreObject`: its
name, the fan-out folder or node that holds it, its size and last write-or-use time), reads
one object bounded by its size, removes one, and describes where it is. The operations here
know nothing about files or Redis: :func:`store_stats` sums the listing per group,
:func:`verify_store` reads every object and checks it as a frame (:func:`check_object`),
:func:`clear_store` removes every object. Only names kvdi writes (32 hex digits, under the
backend's prefix or fan-out folder) are objects; anything else under the root or the prefix is
counted as ``other`` and never read or removed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvdi.connectors.store.framing import HEADER_SIZE, CorruptObjectError, FrameKey, unframe

KEY_HEX = 32  # a block key is 16 bytes, named by its hex
MAX_OBJECT_BYTES = 1 << 30
"""Objects larger than this are reported as ``oversize`` by ``verify`` and never read (a frame of a very
large model's block is a few MiB)."""


def is_hex(name: str) -> bool:
    """True when ``name`` is lowercase hex digits only (and not empty)."""
    return bool(name) and all(c in "0123456789abcdef" for c in name)


def is_key_name(name: str) -> bool:
    """True for the names kvdi gives objects: 32 lowercase hex digits."""
    return len(name) == KEY_HEX and is_hex(name)


@dataclass(frozen=True)
class StoreObject:
    """One stored object. ``ref`` is whatever the backend needs to read or remove it."""

    name: str
    group: str
    size: int
    stamp: float | None  # last write or use, seconds since the epoch (None when the backend cannot say)
    ref: Any = field(default=None, compare=False, repr=False)
    odd: str | None = None  # set when the entry under an object's name is no plain object (e.g. a symlink)


class StoreAdmin(Protocol):
    """One store as the ``kvdi store`` commands see it."""

    kind: str
    """``shared_storage``, ``redis`` or ``redis cluster``."""
    where: str
    """The folder or the (masked) URL and key prefix."""

    def objects(self) -> Iterator[StoreObject]:
        """Every object (and every odd entry under an object's name), in no particular order."""
        ...

    def other_entries(self) -> int:
        """Entries under the root or prefix that are not kvdi objects (counted, never touched)."""
        ...

    def read(self, obj: StoreObject) -> bytes | None:
        """The object's bytes (at most ``obj.size``), or None when it vanished."""
        ...

    def remove(self, obj: StoreObject) -> bool:
        """Remove the object; False when it was already gone."""
        ...

    def close(self) -> None: ...


@dataclass
class GroupStats:
    objects: int = 0
    bytes: int = 0
    oldest: float | None = None
    newest: float | None = None

    def add(self, obj: StoreObject) -> None:
        self.objects += 1
        self.bytes += obj.size
        if obj.stamp is not None:
            self.oldest = obj.stamp if self.oldest is None else min(self.oldest, obj.stamp)
            self.newest = obj.stamp if self.newest is None else max(self.newest, obj.stamp)

    def as_dict(self) -> dict[str, Any]:
        return {"objects": self.objects, "bytes": self.bytes, "oldest": self.oldest, "newest": self.newest}


@dataclass
class StoreStats:
    """Objects and bytes in total and per group (fan-out folder or cluster node); ``other``: foreign entries."""

    kind: str
    where: str
    total: GroupStats
    groups: dict[str, GroupStats]
    other: int
    odd: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "where": self.where,
            **self.total.as_dict(),
            "other_entries": self.other,
            "odd_entries": self.odd,
            "groups": {name: g.as_dict() for name, g in sorted(self.groups.items())},
        }


def store_stats(admin: StoreAdmin) -> StoreStats:
    """Count every object of the store, in total and per group."""
    total = GroupStats()
    groups: dict[str, GroupStats] = {}
    odd = 0
    for obj in admin.objects():
        if obj.odd is not None:
            odd += 1
            continue
        total.add(obj)
        groups.setdefault(obj.group, GroupStats()).add(obj)
    return StoreStats(admin.kind, admin.where, total, groups, admin.other_entries(), odd)


def check_object(data: bytes | None, size: int, key: FrameKey | None, name: str) -> str | None:
    """Why ``data`` (an object of ``size`` bytes stored as ``name``) is no valid kvdi frame, or None when it is one.

    A frame names the block key it was written for: an object under another name (copied, renamed) is bad.

    The frame is checked against itself: its header fields, its length against its size, its
    checksum (and, with ``key``, its MAC). Any layout is valid: a fleet's store holds the
    blocks of several models; a reader of another layout counts them as misses, never loads them.
    """
    if data is None:
        return "vanished"
    if len(data) != size:
        return "length"
    if size < HEADER_SIZE:
        return "length"
    if not is_key_name(name):
        return "name"
    view = memoryview(data)
    try:
        unframe(view, bytes(view[8:24]), size - HEADER_SIZE, key, name=bytes.fromhex(name))
    except CorruptObjectError as exc:
        return exc.reason
    return None


@dataclass
class BadObject:
    name: str
    group: str
    reason: str
    dropped: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "group": self.group, "reason": self.reason, "dropped": self.dropped}


@dataclass
class VerifyReport:
    kind: str
    where: str
    checked: int = 0
    good: int = 0
    bad: list[BadObject] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "where": self.where,
            "checked": self.checked,
            "good": self.good,
            "bad": [b.as_dict() for b in self.bad],
            "seconds": round(self.seconds, 3),
        }


def verify_store(
    admin: StoreAdmin,
    key: FrameKey | None = None,
    drop: bool = False,
    progress: Callable[[int, int], None] | None = None,
    max_object_bytes: int = MAX_OBJECT_BYTES,
) -> VerifyReport:
    """Read and check every object; with ``drop`` remove the bad ones. ``progress(done, total)`` after each."""
    start = time.perf_counter()
    report = VerifyReport(admin.kind, admin.where)
    listing = list(admin.objects())
    for done, obj in enumerate(listing, 1):
        if obj.odd is not None:
            reason: str | None = obj.odd
        elif obj.size > max_object_bytes:
            reason = "oversize"
        else:
            reason = check_object(admin.read(obj), obj.size, key, obj.name)
        report.checked += 1
        if reason == "vanished":  # removed (evicted, cleared) while we looked: neither good nor bad
            report.checked -= 1
        elif reason is None:
            report.good += 1
        else:
            bad = BadObject(obj.name, obj.group, reason)
            if drop:
                bad.dropped = admin.remove(obj)
            report.bad.append(bad)
        if progress is not None:
            progress(done, len(listing))
    report.seconds = time.perf_counter() - start
    return report


def clear_store(admin: StoreAdmin, progress: Callable[[int, int], None] | None = None) -> int:
    """Remove every object (odd entries under object names too); returns how many were removed."""
    listing = list(admin.objects())
    removed = 0
    for done, obj in enumerate(listing, 1):
        removed += admin.remove(obj)
        if progress is not None:
            progress(done, len(listing))
    return removed


__all__ = [
    "MAX_OBJECT_BYTES",
    "BadObject",
    "GroupStats",
    "StoreAdmin",
    "StoreObject",
    "StoreStats",
    "VerifyReport",
    "check_object",
    "clear_store",
    "is_hex",
    "is_key_name",
    "store_stats",
    "verify_store",
]
