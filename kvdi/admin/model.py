"""What every store administration backend offers, and the three operations over it (stats, verify, clear).

A backend (:class:`StoreAdmin`) lists the objects of one store (:class:`StoreObject`: name,
folder or node, size, last write-or-use time), reads a bounded range of objects, removes one.
The operations know nothing about files or Redis: :func:`store_stats` sums the listing per
layout fingerprint, :func:`verify_store` checks each object as a frame, :func:`clear_store`
removes objects; each takes a :class:`~kvdi.admin.select.Selection` (a layout, an age).

Two tests make an entry kvdi's. Its name: 32 hex digits under the backend's prefix or fan-out
folder (anything else is ``other``, never read). Its content: the first :data:`HEAD_BYTES`
bytes, read before anything else, must be a per-rank frame header (magic ``KVDI``) or a
canonical section header bound to the object's name (magic ``KVDC``, :mod:`.sections`); an
entry that is neither (another application's value, a symlink or folder in an object's place)
is ``foreign``: counted and listed, never removed by ``clear`` or ``verify --drop``.
:func:`object_format` tells which: ``per_rank``, ``canonical``, or ``canonical_v1`` (an older
canonical version, which a load counts as a ``version`` miss and ``verify`` reports bad).

Reads are bounded whatever a store claims: the header first, then (``verify``) one frame's
payload (or section) as the header declares it, in :data:`READ_CHUNK` pieces through a streaming hasher, so
memory stays at one chunk per object; an object larger than ``max_object_bytes`` is reported as
``oversize`` and never read past its header.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvdi.admin.sections import HEAD_BYTES, check_section_streamed, has_section_header, section_format
from kvdi.connectors.store.framing import (
    HEADER_SIZE,
    MAGIC,
    CorruptObjectError,
    FrameKey,
    PayloadHasher,
    check_header,
    unframe,
)

KEY_HEX = 32  # a block key is 16 bytes, named by its hex
MAX_OBJECT_BYTES = 1 << 30
"""Objects larger than this are reported as ``oversize`` by ``verify`` and never read (a frame of a very
large model's block is a few MiB)."""
READ_CHUNK = 4 << 20
"""The most bytes of one object held at once while ``verify`` checks it."""
if TYPE_CHECKING:
    from kvdi.admin.select import Selection

Progress = Callable[[int, int], None]
_BATCH = 256  # objects whose headers are read in one call
_LENGTH = struct.Struct("<Q")
_LENGTH_AT = 40  # the header's payload-length field (see kvdi.connectors.store.framing)
PER_RANK = "per_rank"
"""The format label of a per-rank frame (``canonical``, ``canonical_v1``: see :mod:`.sections`)."""
HEAD = max(HEADER_SIZE, HEAD_BYTES)
"""The first bytes read of every object: a whole per-rank or canonical header."""


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

    def read_many(self, objs: Sequence[StoreObject], offset: int, length: int) -> list[bytes | None]:
        """Bytes ``[offset, offset + length)`` of each object (never more; fewer at its end), None when it
        vanished, ``b""`` when it is no plain object (any more)."""
        ...

    def remove(self, obj: StoreObject) -> bool:
        """Remove the object (only ever called for one whose content is a kvdi frame); False when already gone."""
        ...

    def server_info(self) -> dict[str, Any]:
        """What the store's server says about how it keeps objects (Redis: memory policy, keys' TTLs), or {}."""
        ...

    def close(self) -> None: ...


def is_frame_header(head: bytes | None) -> bool:
    """Whether an object's first bytes say it is kvdi's: a whole header opening with the frame magic."""
    return head is not None and len(head) >= HEADER_SIZE and head[: len(MAGIC)] == MAGIC


def object_format(obj: StoreObject, head: bytes) -> str | None:
    """``per_rank``, ``canonical`` or ``canonical_v<N>`` by the object's first bytes; None: not kvdi's (foreign)."""
    return PER_RANK if is_frame_header(head) else section_format(obj.name, head)


def headed(admin: StoreAdmin, listing: Sequence[StoreObject]) -> Iterator[tuple[StoreObject, bytes | None]]:
    """Each listed object with its first :data:`HEAD` bytes (``b""`` for odd entries, None: vanished)."""
    for start in range(0, len(listing), _BATCH):
        batch = listing[start : start + _BATCH]
        plain = [obj for obj in batch if obj.odd is None]
        heads = iter(admin.read_many(plain, 0, HEAD) if plain else [])
        for obj in batch:
            yield obj, (b"" if obj.odd is not None else next(heads))


def selected(selection: Selection | None, obj: StoreObject, head: bytes) -> bool:
    """Whether ``selection`` (None: everything) takes the kvdi object ``obj`` with header ``head``."""
    return selection is None or selection.wants(obj, head)


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


def check_streamed(
    admin: StoreAdmin, obj: StoreObject, head: bytes, key: FrameKey | None, max_object_bytes: int
) -> str | None:
    """Why a kvdi object (``head``: its header) is no valid frame, or None; reads at most one frame, in chunks."""
    if obj.size > max_object_bytes:
        return "oversize"
    if not is_key_name(obj.name):
        return "name"
    (declared,) = _LENGTH.unpack_from(head, _LENGTH_AT)
    if obj.size != HEADER_SIZE + declared:
        return "length"
    name = bytes.fromhex(obj.name)
    try:
        check_header(head, head[8:24], declared, name=name)
        hasher = PayloadHasher(key)
        offset = HEADER_SIZE
        while offset < obj.size:
            want = min(READ_CHUNK, obj.size - offset)
            (piece,) = admin.read_many([obj], offset, want)
            if piece is None:
                return "vanished"
            if len(piece) != want:
                return "length"
            hasher.update(piece)
            offset += want
        hasher.verify(head, head[8:24], declared, name=name)
    except CorruptObjectError as exc:
        return exc.reason
    return None


@dataclass
class BadObject:
    name: str
    group: str
    reason: str
    dropped: bool = False
    format: str = PER_RANK

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "group": self.group, "reason": self.reason, "dropped": self.dropped}
        return out | {"format": self.format}


@dataclass
class ForeignObject:
    """An entry under an object's name whose content is no kvdi frame: reported, never removed."""

    name: str
    group: str
    why: str  # "no frame header", or what the entry is (a symlink, a folder, not a string)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "group": self.group, "why": self.why}


def _foreign(obj: StoreObject, head: bytes) -> ForeignObject:
    unbound = has_section_header(head)  # a canonical header naming another object: copied there, never kvdi's write
    return ForeignObject(obj.name, obj.group, obj.odd or ("section of another name" if unbound else "no frame header"))


@dataclass
class VerifyReport:
    kind: str
    where: str
    checked: int = 0
    good: int = 0
    bad: list[BadObject] = field(default_factory=list)
    seconds: float = 0.0
    foreign: list[ForeignObject] = field(default_factory=list)
    formats: dict[str, int] = field(default_factory=dict)
    """Objects checked (good or bad) by format: ``per_rank``, ``canonical``, ``canonical_v1``."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "where": self.where,
            "checked": self.checked,
            "good": self.good,
            "formats": dict(sorted(self.formats.items())),
            "bad": [b.as_dict() for b in self.bad],
            "foreign": [f.as_dict() for f in self.foreign],
            "seconds": round(self.seconds, 3),
        }


def verify_store(
    admin: StoreAdmin,
    key: FrameKey | None = None,
    drop: bool = False,
    progress: Progress | None = None,
    max_object_bytes: int = MAX_OBJECT_BYTES,
    selection: Selection | None = None,
) -> VerifyReport:
    """Check every kvdi object (at most one frame or section read of each, as a load checks it); with ``drop``
    remove the bad ones. Foreign entries are listed in ``foreign`` and left alone. ``progress(done, total)`` after
    each."""
    start = time.perf_counter()
    report = VerifyReport(admin.kind, admin.where)
    listing = list(admin.objects())
    for done, (obj, head) in enumerate(headed(admin, listing), 1):
        fmt = None if head is None else object_format(obj, head)
        if head is None:
            pass  # vanished since the listing: neither good nor bad
        elif fmt is None:
            report.foreign.append(_foreign(obj, head))
        elif selected(selection, obj, head):
            if fmt == PER_RANK:
                reason = check_streamed(admin, obj, head, key, max_object_bytes)
            else:
                reason = check_section_streamed(admin, obj, head, key, max_object_bytes, READ_CHUNK)
            if reason != "vanished":  # removed (evicted, cleared) while we looked: neither good nor bad
                report.checked += 1
                report.formats[fmt] = report.formats.get(fmt, 0) + 1
            if reason is None:
                report.good += 1
            elif reason != "vanished":
                bad = BadObject(obj.name, obj.group, reason, format=fmt)
                if drop:
                    bad.dropped = admin.remove(obj)
                report.bad.append(bad)
        if progress is not None:
            progress(done, len(listing))
    report.seconds = time.perf_counter() - start
    return report


@dataclass
class ClearReport:
    """What ``clear`` removed (or, in a dry run, would remove) and the foreign entries it left alone."""

    kind: str
    where: str
    removed: list[StoreObject] = field(default_factory=list)
    foreign: list[ForeignObject] = field(default_factory=list)
    dry_run: bool = False
    formats: dict[str, int] = field(default_factory=dict)
    """Objects removed (or that would be) by format: ``per_rank``, ``canonical``, ``canonical_v1``."""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "where": self.where, "foreign": len(self.foreign)}
        out["would_remove" if self.dry_run else "removed"] = len(self.removed)
        out["formats"] = dict(sorted(self.formats.items()))
        if self.dry_run:
            out["objects"] = [{"name": o.name, "group": o.group, "bytes": o.size} for o in self.removed]
        return out


def clear_store(
    admin: StoreAdmin,
    progress: Progress | None = None,
    dry_run: bool = False,
    selection: Selection | None = None,
) -> ClearReport:
    """Remove every (selected) object whose header says it is kvdi's (a per-rank frame or a canonical section bound
    to its name, any version; read right before its removal); foreign entries stay. With ``dry_run`` nothing is
    removed: the report lists what would be."""
    report = ClearReport(admin.kind, admin.where, dry_run=dry_run)
    listing = list(admin.objects())
    for done, (obj, head) in enumerate(headed(admin, listing), 1):
        fmt = None if head is None else object_format(obj, head)
        if head is not None and fmt is None:
            report.foreign.append(_foreign(obj, head))
        elif head is not None and fmt is not None and selected(selection, obj, head) and (dry_run or admin.remove(obj)):
            report.removed.append(obj)
            report.formats[fmt] = report.formats.get(fmt, 0) + 1
        if progress is not None:
            progress(done, len(listing))
    return report


__all__ = [
    "HEAD",
    "MAX_OBJECT_BYTES",
    "PER_RANK",
    "READ_CHUNK",
    "BadObject",
    "ClearReport",
    "ForeignObject",
    "StoreAdmin",
    "StoreObject",
    "VerifyReport",
    "check_object",
    "check_streamed",
    "clear_store",
    "selected",
    "headed",
    "is_frame_header",
    "is_hex",
    "is_key_name",
    "object_format",
    "verify_store",
]
