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
    name_field,
    pack_header,
    unframe,
    verify_pieces,
)
from kvdi.errors import KvdiError

FP = bytes(range(16))
OTHER_FP = bytes(range(1, 17))
NAME = b"N" * 16  # the block key the frames below are stored under
payloads = st.binary(min_size=1, max_size=512)


def frame(payload: bytes, fingerprint: bytes = FP) -> bytearray:
    return bytearray(frame_header(fingerprint, payload, name=NAME) + payload)


@settings(deadline=None)
@given(payloads)
def test_round_trip(payload: bytes) -> None:
    assert bytes(unframe(frame(payload), FP, len(payload), name=NAME)) == payload


@settings(deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=5))
def test_header_of_pieces_equals_header_of_concatenation(pieces: list[bytes]) -> None:
    whole = b"".join(pieces)
    assert frame_header(FP, pieces, name=NAME) == frame_header(FP, whole, name=NAME)
    verify_pieces(frame_header(FP, whole, name=NAME), pieces, FP, len(whole), name=NAME)


@settings(max_examples=300, deadline=None)
@given(payloads, st.data())
def test_every_single_byte_corruption_is_detected(payload: bytes, data: st.DataObject) -> None:
    buf = frame(payload)
    pos = data.draw(st.integers(0, len(buf) - 1), label="position")
    buf[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(CorruptObjectError):
        unframe(buf, FP, len(payload), name=NAME)


@settings(deadline=None)
@given(payloads, st.data())
def test_truncation_anywhere_is_detected(payload: bytes, data: st.DataObject) -> None:
    buf = frame(payload)
    cut = data.draw(st.integers(0, len(buf) - 1))
    with pytest.raises(CorruptObjectError) as info:
        unframe(buf[:cut], FP, len(payload), name=NAME)
    assert info.value.reason == "length"


def test_corrupt_object_error_is_a_kvdi_error() -> None:
    assert issubclass(CorruptObjectError, KvdiError)


def test_bad_magic() -> None:
    buf = frame(b"x" * 8)
    buf[0:4] = b"NOPE"
    with pytest.raises(CorruptObjectError) as info:
        unframe(buf, FP, 8, name=NAME)
    assert info.value.reason == "magic"


def test_wrong_version() -> None:
    buf = frame(b"x" * 8)
    struct.pack_into("<H", buf, 4, FRAME_VERSION + 1)
    with pytest.raises(CorruptObjectError, match="format version") as info:
        unframe(buf, FP, 8, name=NAME)
    assert info.value.reason == "version"


def test_foreign_fingerprint() -> None:
    with pytest.raises(CorruptObjectError) as info:
        unframe(frame(b"x" * 8, OTHER_FP), FP, 8, name=NAME)
    assert info.value.reason == "fingerprint"


def test_wrong_payload_length_for_layout() -> None:
    with pytest.raises(CorruptObjectError) as info:
        unframe(frame(b"x" * 8), FP, 16, name=NAME)
    assert info.value.reason == "length"


def test_trailing_bytes() -> None:
    with pytest.raises(CorruptObjectError) as info:
        unframe(frame(b"x" * 8) + b"!", FP, 8, name=NAME)
    assert info.value.reason == "length"


def test_checksum_mismatch() -> None:
    buf = frame(b"x" * 8)
    buf[-1] ^= 1
    with pytest.raises(CorruptObjectError) as info:
        unframe(buf, FP, 8, name=NAME)
    assert info.value.reason == "checksum"


def test_header_size_keeps_payload_aligned() -> None:
    assert HEADER_SIZE % 8 == 0
    assert len(pack_header(FP, NAME, 0, 0)) == HEADER_SIZE


# -- keyed MAC -----------------------------------------------------------------------------------

KEY = FrameKey(b"k" * 32)
OTHER_KEY = FrameKey(b"o" * 32)


def keyed(payload: bytes, key: FrameKey = KEY) -> bytearray:
    return bytearray(frame_header(FP, payload, key, name=NAME) + payload)


@settings(deadline=None)
@given(payloads)
def test_keyed_round_trip_and_unkeyed_readers_still_check_the_checksum(payload: bytes) -> None:
    buf = keyed(payload)
    assert bytes(unframe(buf, FP, len(payload), KEY, name=NAME)) == payload
    assert bytes(unframe(buf, FP, len(payload), name=NAME)) == payload  # a reader without a key loads it


@settings(max_examples=300, deadline=None)
@given(payloads, st.data())
def test_every_single_byte_corruption_of_a_keyed_frame_is_detected_with_the_key(
    payload: bytes, data: st.DataObject
) -> None:
    buf = keyed(payload)
    pos = data.draw(st.integers(0, len(buf) - 1), label="position")
    buf[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(CorruptObjectError):
        unframe(buf, FP, len(payload), KEY, name=NAME)


def test_a_well_formed_unkeyed_frame_is_refused_by_a_keyed_reader() -> None:
    forged = frame(b"evil" * 4)
    assert bytes(unframe(forged, FP, 16, name=NAME)) == b"evil" * 4
    with pytest.raises(CorruptObjectError) as info:
        unframe(forged, FP, 16, KEY, name=NAME)
    assert info.value.reason == "mac"


def test_a_frame_macced_under_another_key_is_refused() -> None:
    with pytest.raises(CorruptObjectError) as info:
        unframe(keyed(b"x" * 16, OTHER_KEY), FP, 16, KEY, name=NAME)
    assert info.value.reason == "mac"


def test_a_forger_who_recomputes_the_checksum_cannot_reuse_a_mac() -> None:
    buf = keyed(b"a" * 16)
    checked = struct.pack("<4sHH16s16sQ", b"KVDI", FRAME_VERSION, FLAG_MAC, FP, NAME, 16)
    mac = bytes(buf[HEADER_SIZE - 32 : HEADER_SIZE])
    forged = bytearray(pack_header(FP, NAME, 16, checksum([b"b" * 16, checked]), FLAG_MAC, mac) + b"b" * 16)
    assert bytes(unframe(forged, FP, 16, name=NAME)) == b"b" * 16  # fine for the checksum
    with pytest.raises(CorruptObjectError) as info:
        unframe(forged, FP, 16, KEY, name=NAME)
    assert info.value.reason == "mac"


@settings(deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=5))
def test_keyed_header_of_pieces_verifies_piece_by_piece(pieces: list[bytes]) -> None:
    whole = b"".join(pieces)
    header = frame_header(FP, pieces, KEY, name=NAME)
    assert header == frame_header(FP, whole, KEY, name=NAME)
    verify_pieces(header, pieces, FP, len(whole), KEY, name=NAME)
    hasher = PayloadHasher(KEY)
    for piece in pieces:
        hasher.update(piece)
    hasher.verify(header, FP, len(whole), name=NAME)
    with pytest.raises(CorruptObjectError):
        verify_pieces(header, [*pieces, b"!"], FP, len(whole), KEY, name=NAME)


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
            unframe(raw, FP, expected, key, name=NAME)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.sampled_from([None, KEY]))
def test_random_payload_behind_a_valid_looking_header_is_caught(payload: bytes, key: FrameKey | None) -> None:
    header = bytearray(frame_header(FP, bytes(16), name=NAME))  # a real header for another payload
    assume(payload != bytes(16))
    with pytest.raises(CorruptObjectError):
        unframe(header + payload, FP, 16, key, name=NAME)


# -- frames stored under random names ---------------------------------------------------------------

names = st.binary(min_size=0, max_size=40)  # block keys are 16 bytes; other lengths are hashed into the field


@settings(max_examples=300, deadline=None)
@given(payloads, names, names, st.sampled_from([None, KEY]))
def test_a_frame_loads_only_under_the_name_it_was_written_for(
    payload: bytes, written_for: bytes, stored_under: bytes, key: FrameKey | None
) -> None:
    buf = bytearray(frame_header(FP, payload, key, name=written_for) + payload)
    assert bytes(unframe(buf, FP, len(payload), key, name=written_for)) == payload
    assume(stored_under != written_for)
    with pytest.raises(CorruptObjectError) as info:
        unframe(buf, FP, len(payload), key, name=stored_under)
    assert info.value.reason == "name"
    with pytest.raises(CorruptObjectError) as info:
        verify_pieces(buf[:HEADER_SIZE], [buf[HEADER_SIZE:]], FP, len(payload), key, name=stored_under)
    assert info.value.reason == "name"


@settings(max_examples=300, deadline=None)
@given(payloads, names, names, st.sampled_from([None, KEY]))
def test_rewriting_the_name_field_to_match_is_caught_by_the_checksum_or_the_mac(
    payload: bytes, written_for: bytes, stored_under: bytes, key: FrameKey | None
) -> None:
    """An attacker who copies a frame and patches its name field: the checksum (and the MAC) cover the name."""
    assume(name_field(stored_under) != name_field(written_for))
    buf = bytearray(frame_header(FP, payload, key, name=written_for) + payload)
    buf[24:40] = name_field(stored_under)
    with pytest.raises(CorruptObjectError) as info:
        unframe(buf, FP, len(payload), key, name=stored_under)
    assert info.value.reason == ("checksum" if key is None else "mac")


@settings(max_examples=200, deadline=None)
@given(payloads, names, st.data())
def test_every_single_byte_corruption_of_a_named_frame_is_detected(
    payload: bytes, name: bytes, data: st.DataObject
) -> None:
    key = data.draw(st.sampled_from([None, KEY]), label="key")
    buf = bytearray(frame_header(FP, payload, key, name=name) + payload)
    pos = data.draw(st.integers(0, len(buf) - 1), label="position")
    buf[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(CorruptObjectError):
        unframe(buf, FP, len(payload), key, name=name)


def test_a_frame_of_the_previous_format_is_a_miss_not_an_error() -> None:
    """Version 2 headers (72 bytes, no name) read as a counted miss (``version``), never an exception."""
    payload = b"x" * 16
    old = struct.pack("<4sHH16sQQ32s", b"KVDI", 2, 0, FP, 16, checksum([payload]), bytes(32)) + payload
    for key in (None, KEY):
        with pytest.raises(CorruptObjectError) as info:
            unframe(old, FP, 16, key, name=NAME)
        assert info.value.reason in ("version", "length")
