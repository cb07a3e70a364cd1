"""The object format every backend stores: a fixed header, then one block's KV for all layers.

Header (40 bytes, little-endian)::

    magic     4s   b"KVDI"
    version   u16  FRAME_VERSION
    reserved  u16  0
    layout    16s  KVCacheSpec.fingerprint()
    length    u64  payload bytes
    checksum  u64  xxh3_64 of the payload

The payload is layer 0's block (K then V), layer 1's block, ... contiguous, exactly
``layout.block_bytes`` long. A reader checks every header field and the checksum and
raises :class:`CorruptObjectError` with a short ``reason`` for the first one that is off,
so any single corrupted byte anywhere in a frame is detected.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from kvdi.errors import KvdiError
from kvdi.layout import FORMAT_VERSION as FRAME_VERSION

MAGIC = b"KVDI"
FINGERPRINT_BYTES = 16
_HEADER = struct.Struct("<4sHH16sQQ")
HEADER_SIZE = _HEADER.size  # 40: keeps the payload 8-byte aligned

Buffer = bytes | bytearray | memoryview

REASONS = ("magic", "version", "header", "fingerprint", "length", "checksum")


class CorruptObjectError(KvdiError):
    """A stored object is not a valid frame for this layout; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"corrupt KV object ({reason}){': ' + detail if detail else ''}")
        self.reason = reason
        self.detail = detail


def checksum(pieces: Sequence[Buffer]) -> int:
    """xxh3_64 of the concatenation of ``pieces`` (no concatenation is made)."""
    if len(pieces) == 1:
        return int(xxhash.xxh3_64_intdigest(pieces[0]))
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return int(h.intdigest())


def pack_header(fingerprint: bytes, length: int, digest: int) -> bytes:
    """A header for a payload of ``length`` bytes whose xxh3_64 is ``digest``."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"layout fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    return _HEADER.pack(MAGIC, FRAME_VERSION, 0, fingerprint, length, digest)


def frame_header(fingerprint: bytes, payload: Buffer | Sequence[Buffer]) -> bytes:
    """The header to write before ``payload`` (one buffer, or pieces stored back to back)."""
    pieces: Sequence[Buffer] = [payload] if isinstance(payload, bytes | bytearray | memoryview) else payload
    length = sum(memoryview(p).nbytes for p in pieces)
    return pack_header(fingerprint, length, checksum(pieces))


def check_header(header: Buffer, fingerprint: bytes, expected_len: int) -> int:
    """Validate a header against this layout; return the payload checksum it promises."""
    view = memoryview(header)
    if view.nbytes < HEADER_SIZE:
        raise CorruptObjectError("length", f"object of {view.nbytes} B is shorter than a {HEADER_SIZE} B header")
    magic, version, reserved, layout, length, digest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptObjectError("magic", f"expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != FRAME_VERSION:
        raise CorruptObjectError("version", f"format version {version}, this kvdi reads {FRAME_VERSION}")
    if reserved != 0:
        raise CorruptObjectError("header", f"reserved field is {reserved}, expected 0")
    if layout != fingerprint:
        raise CorruptObjectError("fingerprint", "object was written for another KV layout (model, dtype or block size)")
    if length != expected_len:
        raise CorruptObjectError("length", f"header says {length} B of payload, layout needs {expected_len} B")
    return int(digest)


def unframe(buf: Buffer, fingerprint: bytes, expected_len: int) -> memoryview:
    """The payload of a whole frame, checked field by field; raises CorruptObjectError."""
    view = memoryview(buf).cast("B")
    digest = check_header(view[:HEADER_SIZE], fingerprint, expected_len)
    if view.nbytes != HEADER_SIZE + expected_len:
        what = "truncated" if view.nbytes < HEADER_SIZE + expected_len else "has trailing bytes"
        expected = HEADER_SIZE + expected_len
        raise CorruptObjectError("length", f"object of {view.nbytes} B {what} (expected {expected} B)")
    payload = view[HEADER_SIZE:]
    if checksum([payload]) != digest:
        raise CorruptObjectError("checksum", "payload does not match its xxh3_64 checksum")
    return payload


def verify_pieces(header: Buffer, pieces: Sequence[Buffer], fingerprint: bytes, expected_len: int) -> None:
    """Check a frame that was read straight into ``pieces`` (its header read separately)."""
    digest = check_header(header, fingerprint, expected_len)
    got = sum(memoryview(p).nbytes for p in pieces)
    if got != expected_len:
        raise CorruptObjectError("length", f"read {got} B of payload, expected {expected_len} B")
    if checksum(pieces) != digest:
        raise CorruptObjectError("checksum", "payload does not match its xxh3_64 checksum")


__all__ = [
    "FRAME_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "REASONS",
    "CorruptObjectError",
    "check_header",
    "checksum",
    "frame_header",
    "pack_header",
    "unframe",
    "verify_pieces",
]
