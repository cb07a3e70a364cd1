"""Canonical packs (``format=canonical``, docs/stored-format.md) as ``kvdi store`` sees them.

An object is a canonical pack kvdi wrote (one or more framed sections of one writer rank) when its
first 128 bytes are a whole canonical header (magic ``KVDC``) whose name field is the object's own
name: the binding every load checks, so another application's value that happens to open with the
magic, or a pack copied under another name, is never taken for one (it is foreign: listed, never
removed). An object of another format version (2: one section an object; 1: payload order
``LKHTD``; a load counts either as a ``version`` miss) is kvdi's too, told apart by
:func:`section_format`. ``verify`` checks each section of a pack as a load would, against itself
(:func:`check_section_streamed`: a store holds every model's packs), reusing the loader's own
checks in :mod:`kvdi.connectors.store.canonical`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvdi.connectors.store.canonical import (
    CANONICAL_VERSION,
    HEADER_SIZE,
    MAGIC,
    Section,
    declared_section,
    section_identity,
    verify_section,
)
from kvdi.connectors.store.framing import CorruptObjectError, FrameKey, name_field

if TYPE_CHECKING:
    from kvdi.admin.model import StoreAdmin, StoreObject

CANONICAL = "canonical"
"""The format label of a section of this kvdi's version (``canonical_v1`` etc. for others)."""
HEAD_BYTES = HEADER_SIZE
"""A canonical header's size (128 B): what is read of an object to tell a section (a per-rank header is 88 B)."""


def has_section_header(head: bytes) -> bool:
    """Whether an object's first bytes are a whole header opening with the canonical magic (bound or not)."""
    return len(head) >= HEADER_SIZE and head[: len(MAGIC)] == MAGIC


def section_format(name: str, head: bytes) -> str | None:
    """``canonical`` (this kvdi's version) or ``canonical_v<N>`` when ``head`` (an object's first bytes, stored
    under the 32-hex-digit ``name``) is a whole canonical header bound to that name; None otherwise."""
    if not has_section_header(head):
        return None
    version, _, stored_name = section_identity(head)
    try:
        if stored_name != name_field(bytes.fromhex(name)):
            return None
    except ValueError:
        return None
    return CANONICAL if version == CANONICAL_VERSION else f"{CANONICAL}_v{version}"


def group_of(fmt: str, head: bytes) -> str:
    """The ``stats`` row of a pack: ``canonical:<fingerprint>`` (``canonical_v<N>:<fingerprint>`` for version N)."""
    return f"{fmt}:{section_identity(head)[1].hex()}"


def _chunks(admin: StoreAdmin, obj: StoreObject, chunk: int, start: int, end: int) -> Iterator[bytes]:
    """Bytes ``start`` .. ``end`` of ``obj`` in pieces of at most ``chunk`` bytes (one in memory at a time);
    CorruptObjectError ``vanished`` or ``length`` when the store has less than its size."""
    offset = start
    while offset < end:
        want = min(chunk, end - offset)
        (piece,) = admin.read_many([obj], offset, want)
        if piece is None:
            raise CorruptObjectError("vanished", "removed while it was read")
        if len(piece) != want:
            raise CorruptObjectError("length", f"{len(piece)} B where {want} B were expected")
        yield piece
        offset += want


def check_section_streamed(
    admin: StoreAdmin, obj: StoreObject, head: bytes, key: FrameKey | None, max_object_bytes: int, chunk: int
) -> str | None:
    """Why the canonical pack ``obj`` (``head``: its first bytes) would not load, or None when it would.

    A pack is one or more framed sections of consecutive heads (its size says how many; they must make a pack
    a writer can write: a head count dividing the model's, aligned). Every header field of each is checked as a
    load checks it (magic, version, flags, name, the section's ranges a cell of the model's grid, the declared
    length), then its checksum or, with ``key``, its MAC over the payload streamed in ``chunk`` pieces; any
    model is valid (the fingerprint a load compares with its own is unknown here)."""
    if obj.size > max_object_bytes:
        return "oversize"
    try:
        fingerprint, geometry, first = declared_section(head)
        frame = HEADER_SIZE + geometry.section_bytes(first)
        heads = obj.size // frame * first.head_count
        if obj.size % frame or geometry.num_kv_heads % heads or first.head_start % heads:
            return "length"  # (a header declaring another length is one too: checked with every field below)
        for k in range(obj.size // frame):
            at = k * frame
            header = head[:HEADER_SIZE] if k == 0 else next(_chunks(admin, obj, HEADER_SIZE, at, at + HEADER_SIZE))
            section = Section(first.layer_start, first.layer_count, first.head_start + k * first.head_count,
                              first.head_count)  # fmt: skip
            chunks = _chunks(admin, obj, chunk, at + HEADER_SIZE, at + frame)
            name = bytes.fromhex(obj.name)
            verify_section(header, chunks, geometry, section, key, name=name, fingerprint=fingerprint)
    except CorruptObjectError as exc:
        return exc.reason
    return None


__all__ = [
    "CANONICAL",
    "HEAD_BYTES",
    "check_section_streamed",
    "group_of",
    "has_section_header",
    "section_format",
]
