"""Frames: round trip, and every field (and every single byte) checked on read."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdi.connectors.framing import (
    FRAME_VERSION,
    HEADER_SIZE,
    CorruptObjectError,
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
