"""Frames: round trip, and every field (and every single byte) checked on read."""

from __future__ import annotations

import struct

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvdi.connectors.store.framing import (
    FLAG_MAC,
    FRAME_VERSION,
    HEADER_SIZE,
    CorruptObjectError,
    FrameKey,
    PayloadHasher,
    checksum,
    frame_header,
    pack_header,
    unframe,
    verify_pieces,
)
from kvdi.errors import KvdiError

FP = bytes(range(16))
OTHER_FP = bytes(range(1, 17))
payloads = st.binary(min_size=1, max_size=512)


def frame(payload: bytes, fingerprint: bytes = FP) -> bytearray:
    return bytearray(frame_header(fingerprint, payload) + payload)


@settings(deadline=None)
@given(payloads)
def test_round_trip(payload: bytes) -> None:
    assert bytes(unframe(frame(payload), FP, len(payload))) == payload


@settings(deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=5))
def test_header_of_pieces_equals_header_of_concatenation(pieces: list[bytes]) -> None:
    whole = b"".join(pieces)
    assert frame_header(FP, pieces) == frame_header(FP, whole)
    verify_pieces(frame_header(FP, whole), pieces, FP, len(whole))


@settings(max_examples=300, deadline=None)
@given(payloads, st.data())
def test_every_single_byte_corruption_is_detected(payload: bytes, data: st.DataObject) -> None:
    buf = frame(payload)
    pos = data.draw(st.integers(0, len(buf) - 1), label="position")
    buf[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(CorruptObjectError):
        unframe(buf, FP, len(payload))


@settings(deadline=None)
@given(payloads, st.data())
def test_truncation_anywhere_is_detected(payload: bytes, data: st.DataObject) -> None:
    buf = frame(payload)
    cut = data.draw(st.integers(0, len(buf) - 1))
    with pytest.raises(CorruptObjectError) as info:
        unframe(buf[:cut], FP, len(payload))
    assert info.value.reason == "length"


def test_corrupt_object_error_is_a_kvdi_error() -> None:
    assert issubclass(CorruptObjectError, KvdiError)


def test_bad_magic() -> None:
    buf = frame(b"x" * 8)
    buf[0:4] = b"NOPE"
    with pytest.raises(CorruptObjectError) as info:
        unframe(buf, FP, 8)
    assert info.value.reason == "magic"


def test_wrong_version() -> None:
    buf = frame(b"x" * 8)
    struct.pack_into("<H", buf, 4, FRAME_VERSION + 1)
    with pytest.raises(CorruptObjectError, match="format version") as info:
        unframe(buf, FP, 8)
    assert info.value.reason == "version"


def test_foreign_fingerprint() -> None:
    with pytest.raises(CorruptObjectError) as info:
        unframe(frame(b"x" * 8, OTHER_FP), FP, 8)
    assert info.value.reason == "fingerprint"


def test_wrong_payload_length_for_layout() -> None:
    with pytest.raises(CorruptObjectError) as info:
        unframe(frame(b"x" * 8), FP, 16)
    assert info.value.reason == "length"


def test_trailing_bytes() -> None:
    with pytest.raises(CorruptObjectError) as info:
        unframe(frame(b"x" * 8) + b"!", FP, 8)
    assert info.value.reason == "length"


def test_checksum_mismatch() -> None:
    buf = frame(b"x" * 8)
    buf[-1] ^= 1
    with pytest.raises(CorruptObjectError) as info:
        unframe(buf, FP, 8)
    assert info.value.reason == "checksum"


def test_header_size_keeps_payload_aligned() -> None:
    assert HEADER_SIZE % 8 == 0
    assert len(pack_header(FP, 0, 0)) == HEADER_SIZE


# -- keyed MAC -----------------------------------------------------------------------------------

KEY = FrameKey(b"k" * 32)
OTHER_KEY = FrameKey(b"o" * 32)


def keyed(payload: bytes, key: FrameKey = KEY) -> bytearray:
    return bytearray(frame_header(FP, payload, key) + payload)


@settings(deadline=None)
@given(payloads)
def test_keyed_round_trip_and_unkeyed_readers_still_check_the_checksum(payload: bytes) -> None:
    buf = keyed(payload)
    assert bytes(unframe(buf, FP, len(payload), KEY)) == payload
    assert bytes(unframe(buf, FP, len(payload))) == payload  # a reader without a key loads it


@settings(max_examples=300, deadline=None)
@given(payloads, st.data())
def test_every_single_byte_corruption_of_a_keyed_frame_is_detected_with_the_key(
    payload: bytes, data: st.DataObject
) -> None:
    buf = keyed(payload)
    pos = data.draw(st.integers(0, len(buf) - 1), label="position")
    buf[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(CorruptObjectError):
        unframe(buf, FP, len(payload), KEY)


def test_a_well_formed_unkeyed_frame_is_refused_by_a_keyed_reader() -> None:
    forged = frame(b"evil" * 4)
    assert bytes(unframe(forged, FP, 16)) == b"evil" * 4
    with pytest.raises(CorruptObjectError) as info:
        unframe(forged, FP, 16, KEY)
    assert info.value.reason == "mac"


def test_a_frame_macced_under_another_key_is_refused() -> None:
    with pytest.raises(CorruptObjectError) as info:
        unframe(keyed(b"x" * 16, OTHER_KEY), FP, 16, KEY)
    assert info.value.reason == "mac"


def test_a_forger_who_recomputes_the_checksum_cannot_reuse_a_mac() -> None:
    buf = keyed(b"a" * 16)
    forged = bytearray(pack_header(FP, 16, checksum([b"b" * 16]), FLAG_MAC, bytes(buf[40:HEADER_SIZE])) + b"b" * 16)
    assert bytes(unframe(forged, FP, 16)) == b"b" * 16  # fine for the checksum
    with pytest.raises(CorruptObjectError) as info:
        unframe(forged, FP, 16, KEY)
    assert info.value.reason == "mac"


@settings(deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=5))
def test_keyed_header_of_pieces_verifies_piece_by_piece(pieces: list[bytes]) -> None:
    whole = b"".join(pieces)
    header = frame_header(FP, pieces, KEY)
    assert header == frame_header(FP, whole, KEY)
    verify_pieces(header, pieces, FP, len(whole), KEY)
    hasher = PayloadHasher(KEY)
    for piece in pieces:
        hasher.update(piece)
    hasher.verify(header, FP, len(whole))
    with pytest.raises(CorruptObjectError):
        verify_pieces(header, [*pieces, b"!"], FP, len(whole), KEY)


def test_frame_key_never_shows_its_secret() -> None:
    key = FrameKey(b"super-secret-value")
    assert "super" not in repr(key) and "super" not in str(key)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        FrameKey(b"short")


# -- random bytes are never a frame ----------------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=HEADER_SIZE + 64), st.sampled_from([None, KEY]))
def test_random_bytes_never_unframe_and_never_raise_anything_else(raw: bytes, key: FrameKey | None) -> None:
    for expected in (0, 8, 16, max(0, len(raw) - HEADER_SIZE)):
        with pytest.raises(CorruptObjectError):
            unframe(raw, FP, expected, key)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.sampled_from([None, KEY]))
def test_random_payload_behind_a_valid_looking_header_is_caught(payload: bytes, key: FrameKey | None) -> None:
    header = bytearray(frame_header(FP, bytes(16)))  # a real header for another payload
    assume(payload != bytes(16))
    with pytest.raises(CorruptObjectError):
        unframe(header + payload, FP, 16, key)
