"""The object format every backend stores: a fixed header, then one block's KV for all layers.

Header (88 bytes, little-endian)::

    magic     4s   b"KVDI"
    version   u16  FRAME_VERSION (2: the MAC field was added; 3: the name field was added)
    flags     u16  bit 0 (FLAG_MAC): the frame carries a keyed MAC;
                   bit 1 (FLAG_ZSTD): the payload is stored zstd-compressed;
                   bit 2 (FLAG_SPLIT, only with FLAG_ZSTD): the block's bytes were split by their position
                   in the element (byte-shuffled) before zstd; the payload starts with one byte, the element
                   size, then one zstd frame per byte position; no other bit is defined
    layout    16s  KVCacheSpec.fingerprint()
    name      16s  the block key the object is stored under (BLAKE2b-128 of it when not 16 bytes)
    length    u64  payload bytes as stored (compressed: fewer than ``layout.block_bytes``)
    checksum  u64  xxh3_64(payload || header[:48]) (always written; covers the name)
    mac       32s  HMAC-SHA256(key, payload || header[:56]) when FLAG_MAC is set, else 32 zero bytes

The payload is layer 0's block (K then V), layer 1's block, ... contiguous, exactly
``layout.block_bytes`` long, or (``FLAG_ZSTD``) one zstd frame that decompresses to exactly that,
or (``FLAG_ZSTD | FLAG_SPLIT``) the element size in one byte and then, back to back, one zstd frame
per position in the element (all first bytes, all second bytes, ...), decompressing to that in all
(:mod:`.codec`: network stores with ``compression`` set write such frames; any reader decompresses
them into its destination with the output bounded to ``block_bytes``). A reader checks every header
field and then the payload and raises :class:`CorruptObjectError` with a short ``reason`` for the
first thing that is off, so any single corrupted byte anywhere in an unkeyed frame is detected. A
frame names the block key it was written for and every reader passes the key it looked up
(``name=``): an object copied or renamed under another block's name (another prompt, salt, rank or
layout) is a miss (reason ``name``), with or without a key.

The checksum stops accidents, not a writer with access to the store. With a
:class:`FrameKey` (``KVDI_INTEGRITY_KEY``), writers add the keyed MAC and readers accept only
frames whose MAC verifies under that key: an unkeyed frame, or one made with another key, is a
miss (reason ``mac``). A reader without a key checks the xxh3 checksum of any frame. Every
function below takes ``key=None`` by default, so callers that pass no key keep working.

Compression kept the frame version: an uncompressed frame is byte for byte what it was, and a
reader from before ``FLAG_ZSTD`` rejects any unknown flag (reason ``header``), so it counts a
compressed frame as a miss and never loads its bytes; likewise a reader that knows ``FLAG_ZSTD`` but
not ``FLAG_SPLIT`` counts a split frame as a ``header`` miss. The checksum and the MAC cover the payload
as stored (compressed) and the header, so a corrupted compressed object is caught before any
decompression; a compressed payload that does not decompress to exactly ``block_bytes`` is a
miss (reason ``codec``).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence
from typing import Any, cast

import xxhash

from kvdi.errors import KvdiError
from kvdi.layout import FORMAT_VERSION as FRAME_VERSION

MAGIC = b"KVDI"
FINGERPRINT_BYTES = 16
MAC_BYTES = 32
FLAG_MAC = 1
FLAG_ZSTD = 2
FLAG_SPLIT = 4
CODEC_FLAGS = FLAG_ZSTD | FLAG_SPLIT
KNOWN_FLAGS = FLAG_MAC | CODEC_FLAGS
NAME_BYTES = 16
_CHECKED = struct.Struct("<4sHH16s16sQ")  # everything the checksum covers besides the payload
_FIELDS = struct.Struct("<4sHH16s16sQQ")  # everything the MAC covers besides the payload
_HEADER = struct.Struct(f"<4sHH16s16sQQ{MAC_BYTES}s")
_LENGTH = struct.Struct("<Q")
_LENGTH_AT = 40  # offset of the length field
HEADER_SIZE = _HEADER.size  # 88: keeps the payload 8-byte aligned
_NO_MAC = bytes(MAC_BYTES)
MIN_KEY_BYTES = 16

Buffer = bytes | bytearray | memoryview

REASONS = ("magic", "version", "header", "fingerprint", "name", "length", "checksum", "mac", "codec")


class CorruptObjectError(KvdiError):
    """A stored object is not a valid frame for this layout; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"corrupt KV object ({reason}){': ' + detail if detail else ''}")
        self.reason = reason
        self.detail = detail


class FrameKey:
    """The secret that MACs frames. Its ``repr`` never shows the secret.

    ``secret`` is any byte string of at least :data:`MIN_KEY_BYTES` bytes; it is hashed into a
    frame-MAC key of its own (domain-separated), so the same secret used elsewhere gives other MACs.
    """

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"an integrity key needs at least {MIN_KEY_BYTES} bytes, got {len(secret)}")
        self._key = hashlib.sha256(b"kvdi-frame-mac-v2\x00" + secret).digest()

    def mac(self) -> Any:
        """A fresh HMAC-SHA256 object under this key (``update`` / ``digest``)."""
        return hmac.new(self._key, digestmod="sha256")

    def __repr__(self) -> str:
        return "FrameKey(***)"


def checksum(pieces: Sequence[Buffer]) -> int:
    """xxh3_64 of the concatenation of ``pieces`` (no concatenation is made)."""
    if len(pieces) == 1:
        return int(xxhash.xxh3_64_intdigest(pieces[0]))
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return int(h.intdigest())


def name_field(name: Buffer) -> bytes:
    """What a header stores for block key ``name``: the key itself when it has 16 bytes, else its BLAKE2b-128."""
    raw = bytes(name)
    if len(raw) == NAME_BYTES:
        return raw
    return hashlib.blake2b(raw, digest_size=NAME_BYTES, person=b"kvdi-frame-name").digest()


def pack_header(
    fingerprint: bytes, name: Buffer, length: int, digest: int, flags: int = 0, mac: bytes = _NO_MAC
) -> bytes:
    """A header for a payload of ``length`` bytes stored under ``name`` whose frame checksum is ``digest``."""
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"layout fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    return _HEADER.pack(MAGIC, FRAME_VERSION, flags, fingerprint, name_field(name), length, digest, mac)


def frame_header(
    fingerprint: bytes,
    payload: Buffer | Sequence[Buffer],
    key: FrameKey | None = None,
    *,
    name: Buffer,
    codec: int = 0,
) -> bytes:
    """The header to write before ``payload`` (one buffer, or pieces stored back to back) stored under the
    block key ``name``; MACed with ``key``. The checksum and the MAC both cover the name. ``codec``:
    :data:`FLAG_ZSTD` when ``payload`` is the compressed block, ``FLAG_ZSTD | FLAG_SPLIT`` when it is the
    split one (see :mod:`.codec`), else 0."""
    if codec not in (0, FLAG_ZSTD, CODEC_FLAGS):
        raise ValueError(f"codec must be 0, FLAG_ZSTD ({FLAG_ZSTD}) or CODEC_FLAGS ({CODEC_FLAGS}), got {codec}")
    pieces: Sequence[Buffer] = [payload] if isinstance(payload, bytes | bytearray | memoryview) else payload
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"layout fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    h = xxhash.xxh3_64()  # one pass, no per-piece bookkeeping: a block is tens of pieces, framed per save
    length = 0
    for p in pieces:
        length += p.nbytes if isinstance(p, memoryview) else memoryview(p).nbytes
        h.update(p)
    flags = (0 if key is None else FLAG_MAC) | codec
    field = name_field(name)
    checked = _CHECKED.pack(MAGIC, FRAME_VERSION, flags, fingerprint, field, length)
    h.update(checked)
    digest = int(h.intdigest())
    if key is None:
        return _HEADER.pack(MAGIC, FRAME_VERSION, flags, fingerprint, field, length, digest, _NO_MAC)
    mac = key.mac()
    for piece in pieces:
        mac.update(piece)
    mac.update(checked + digest.to_bytes(8, "little"))
    return pack_header(fingerprint, name, length, digest, flags, mac.digest())


def check_header(header: Buffer, fingerprint: bytes, expected_len: int, *, name: Buffer) -> int:
    """Validate a header against this layout and the block key ``name``; return the checksum it promises.

    This checks the fields only (checksum and MAC need the payload: see :class:`PayloadHasher`). A
    compressed frame's stored length may be anything from 1 to ``expected_len`` (:func:`stored_length`).
    """
    return read_header(header, fingerprint, expected_len, name=name)[0]


def stored_length(header: Buffer) -> int:
    """The payload bytes a (checked) header says are stored after it."""
    return int(_LENGTH.unpack_from(memoryview(header).cast("B"), _LENGTH_AT)[0])


def frame_codec(header: Buffer) -> int:
    """The codec flags of a (checked) header: :data:`FLAG_ZSTD`, ``FLAG_ZSTD | FLAG_SPLIT``, or 0 (stored as it is)."""
    return int(memoryview(header).cast("B")[6]) & CODEC_FLAGS


def read_header(header: Buffer, fingerprint: bytes, expected_len: int, *, name: Buffer) -> tuple[int, int]:
    """:func:`check_header`, returning the checksum the header promises and the payload length it stores."""
    view = memoryview(header).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptObjectError("length", f"object of {view.nbytes} B is shorter than a {HEADER_SIZE} B header")
    magic, version, flags, layout, stored_name, length, digest, mac = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptObjectError("magic", f"expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != FRAME_VERSION:
        raise CorruptObjectError("version", f"format version {version}, this kvdi reads {FRAME_VERSION}")
    if flags & ~KNOWN_FLAGS:
        raise CorruptObjectError("header", f"unknown flags {flags:#x}")
    if flags & FLAG_SPLIT and not flags & FLAG_ZSTD:
        raise CorruptObjectError("header", "the split flag without the zstd flag")
    if bool(flags & FLAG_MAC) == (mac == _NO_MAC):  # a MAC flag with no MAC, or MAC bytes without the flag
        raise CorruptObjectError("header", "the MAC flag and the MAC field disagree")
    if layout != fingerprint:
        raise CorruptObjectError("fingerprint", "object was written for another KV layout (model, dtype or block size)")
    if stored_name != name_field(name):
        raise CorruptObjectError("name", "object was written for another block (copied or renamed in the store)")
    if flags & FLAG_ZSTD:
        if not 0 < length <= expected_len:
            raise CorruptObjectError("length", f"header says {length} B compressed, at most {expected_len} B allowed")
    elif length != expected_len:
        raise CorruptObjectError("length", f"header says {length} B of payload, layout needs {expected_len} B")
    return int(digest), int(length)


class PayloadHasher:
    """Checks a payload that arrives in pieces against its frame header: ``update`` each piece, then ``verify``.

    Without a key it compares the xxh3_64 checksum; with a key it requires a frame MACed under
    that key and compares the MAC (constant time) instead.
    """

    def __init__(self, key: FrameKey | None = None) -> None:
        self.key = key
        self.nbytes = 0
        self._mac = key.mac() if key is not None else None
        self._xxh = xxhash.xxh3_64() if key is None else None

    def update(self, piece: Buffer) -> None:
        self.nbytes += memoryview(piece).nbytes
        if self._mac is not None:
            self._mac.update(piece)
        elif self._xxh is not None:
            self._xxh.update(piece)

    def feed(self, nbytes: int) -> Callable[[Buffer], None]:
        """The checksum's (or the MAC's) own ``update``, for a caller that passes exactly ``nbytes`` of payload
        through it: no bookkeeping per piece, which counts when a block is tens of pieces. Then :meth:`verify`."""
        self.nbytes += nbytes
        hasher = self._mac if self._mac is not None else self._xxh
        assert hasher is not None
        return cast(Callable[[Buffer], None], hasher.update)

    def verify(
        self,
        header: Buffer,
        fingerprint: bytes,
        expected_len: int,
        *,
        name: Buffer,
        read: tuple[int, int] | None = None,
    ) -> None:
        """Raise :class:`CorruptObjectError` unless header and payload form a valid frame of block ``name``.
        ``read``: what :func:`read_header` returned for this very header (not read again)."""
        digest, length = read if read is not None else read_header(header, fingerprint, expected_len, name=name)
        if self.nbytes != length:
            raise CorruptObjectError("length", f"read {self.nbytes} B of payload, expected {length} B")
        view = memoryview(header).cast("B")
        if self._mac is None:
            if self._xxh is None:
                raise CorruptObjectError("checksum", "payload does not match its frame checksum")
            self._xxh.update(view[: _CHECKED.size])
            if self._xxh.intdigest() != digest:
                raise CorruptObjectError("checksum", "payload does not match its frame checksum")
            return
        if view[6] & FLAG_MAC == 0:
            raise CorruptObjectError("mac", "object carries no MAC but an integrity key is set")
        self._mac.update(view[: _FIELDS.size])
        if not hmac.compare_digest(self._mac.digest(), view[_FIELDS.size : HEADER_SIZE]):
            raise CorruptObjectError("mac", "MAC does not verify under this integrity key (forged or other key)")


def unframe(
    buf: Buffer, fingerprint: bytes, expected_len: int, key: FrameKey | None = None, *, name: Buffer
) -> memoryview:
    """The payload of a whole frame stored under block key ``name``, checked field by field (and its MAC
    with ``key``); raises CorruptObjectError. A compressed frame's payload is returned as stored:
    see :func:`frame_codec`, and :func:`kvdi.connectors.store.codec.unframe_into` to place it."""
    view = memoryview(buf).cast("B")
    digest, length = read_header(view[:HEADER_SIZE], fingerprint, expected_len, name=name)
    if view.nbytes != HEADER_SIZE + length:
        what = "truncated" if view.nbytes < HEADER_SIZE + length else "has trailing bytes"
        expected = HEADER_SIZE + length
        raise CorruptObjectError("length", f"object of {view.nbytes} B {what} (expected {expected} B)")
    payload = view[HEADER_SIZE:]
    if key is None:  # the common case: no hasher object
        if checksum([payload, view[: _CHECKED.size]]) != digest:
            raise CorruptObjectError("checksum", "payload does not match its frame checksum")
        return payload
    hasher = PayloadHasher(key)
    hasher.update(payload)
    hasher.verify(view[:HEADER_SIZE], fingerprint, expected_len, name=name)
    return payload


def verify_pieces(
    header: Buffer,
    pieces: Sequence[Buffer],
    fingerprint: bytes,
    expected_len: int,
    key: FrameKey | None = None,
    *,
    name: Buffer,
) -> None:
    """Check a frame of block ``name`` that was read straight into ``pieces`` (its header read separately)."""
    hasher = PayloadHasher(key)
    check_header(header, fingerprint, expected_len, name=name)  # header faults first, before hashing anything
    for piece in pieces:
        hasher.update(piece)
    hasher.verify(header, fingerprint, expected_len, name=name)


__all__ = [
    "CODEC_FLAGS",
    "FLAG_MAC",
    "FLAG_SPLIT",
    "FLAG_ZSTD",
    "FRAME_VERSION",
    "HEADER_SIZE",
    "KNOWN_FLAGS",
    "MAC_BYTES",
    "MAGIC",
    "NAME_BYTES",
    "REASONS",
    "Buffer",
    "CorruptObjectError",
    "FrameKey",
    "PayloadHasher",
    "check_header",
    "checksum",
    "frame_codec",
    "frame_header",
    "name_field",
    "pack_header",
    "read_header",
    "stored_length",
    "unframe",
    "verify_pieces",
]
