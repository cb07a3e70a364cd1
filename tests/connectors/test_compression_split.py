"""The dense codec (``compression=zstd-split``): bytes split by their place in the element, then zstd."""

from __future__ import annotations

import pytest

zstandard = pytest.importorskip("zstandard")
torch = pytest.importorskip("torch")

from kvdi.connectors.store.codec import Compressor, compressor_for, unframe_into  # noqa: E402
from kvdi.connectors.store.codec_split import join_into, split_bytes  # noqa: E402
from kvdi.connectors.store.framing import (  # noqa: E402
    CODEC_FLAGS,
    FLAG_SPLIT,
    FLAG_ZSTD,
    HEADER_SIZE,
    CorruptObjectError,
    FrameKey,
    frame_codec,
    frame_header,
    unframe,
)
from kvdi.testing.conformance import KEYS, LAYOUT  # noqa: E402
from tests.connectors.test_compression import framing_at, placed, plain  # noqa: E402

FP = LAYOUT.fingerprint()
N = LAYOUT.block_bytes
NAME = KEYS[0]
ZSTD_ONLY_COMMIT = "1aa8d75"  # the last commit whose reader knew FLAG_ZSTD but not FLAG_SPLIT


def bf16_block(nbytes: int, seed: int = 7) -> bytes:
    """KV-like bf16 bytes: small normal values (a narrow band of exponents), seeded."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(nbytes // 2, generator=generator) * 0.05
    return values.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def test_split_groups_bytes_by_position_and_joins_them_back_across_pieces() -> None:
    payload = bytes(range(16))
    planes = split_bytes([payload[:6], payload[6:]], 16, 2)
    assert [bytes(p) for p in planes] == [bytes(range(0, 16, 2)), bytes(range(1, 16, 2))]
    split = b"".join(planes)
    out = bytearray(16)
    join_into(split, [memoryview(out)[:4], memoryview(out)[4:]], 2)
    assert bytes(out) == payload


@pytest.mark.parametrize("key", [None, FrameKey(b"k" * 32)], ids=["unkeyed", "mac"])
@pytest.mark.parametrize("element", [2, 4])
def test_a_split_frame_carries_both_flags_and_is_placed_back_exactly(key: FrameKey | None, element: int) -> None:
    block = bf16_block(N)
    stored = b"".join(Compressor("zstd-split", key, element_bytes=element).frame(NAME, plain(block, key)))
    assert frame_codec(stored[:HEADER_SIZE]) == CODEC_FLAGS
    assert stored[HEADER_SIZE] == element  # the element size leads the payload
    assert placed(stored, key, cut=N // 2 - element * 3) == block


def test_on_bf16_kv_the_split_codec_stores_fewer_bytes_than_plain_zstd() -> None:
    block = bf16_block(256 << 10)
    fp = LAYOUT.fingerprint()
    framed = [frame_header(fp, block, name=NAME), block]
    fast = len(b"".join(Compressor("zstd").frame(NAME, framed)))
    dense = len(b"".join(Compressor("zstd-split", element_bytes=2).frame(NAME, framed)))
    assert dense < fast < len(block) + HEADER_SIZE


def test_element_size_one_is_plain_zstd() -> None:
    compressor = compressor_for("zstd-split", None, "KVDI_S3__COMPRESSION", 1)
    assert compressor is not None
    stored = b"".join(compressor.frame(NAME, plain(bytes(N))))
    assert frame_codec(stored[:HEADER_SIZE]) & FLAG_SPLIT == 0


def test_a_block_of_partial_elements_is_stored_plain_zstd_and_read_back() -> None:
    payload = bytes(4098)  # not whole 4-byte elements (never from a layout): no split, still compressed
    stored = b"".join(
        Compressor("zstd-split", element_bytes=4).frame(NAME, [frame_header(FP, payload, name=NAME), payload])
    )
    assert frame_codec(stored[:HEADER_SIZE]) == FLAG_ZSTD
    out = bytearray(len(payload))
    unframe_into(stored, [memoryview(out)], FP, len(payload), name=NAME)
    assert bytes(out) == payload


def _split_frame(payload: bytes) -> bytes:
    return frame_header(FP, payload, name=NAME, codec=CODEC_FLAGS) + payload  # checksum valid: only the codec is off


@pytest.mark.parametrize(
    "payload",
    [
        bytes([3]) + zstandard.ZstdCompressor().compress(bytes(N)),  # an element size a layout never has
        b"",  # no room for the element size (a length miss first)
        bytes([2]) + zstandard.ZstdCompressor().compress(bytes(N // 2 - 1)) * 2,  # one element short
        bytes([2]) + zstandard.ZstdCompressor().compress(bytes(N // 2)) * 3,  # a plane too many
        bytes([2]) + b"not zstd",
    ],
    ids=["odd-element", "empty", "short", "long", "garbage"],
)
def test_a_split_payload_that_does_not_decode_to_one_block_is_a_miss(payload: bytes) -> None:
    with pytest.raises(CorruptObjectError) as caught:
        placed(_split_frame(payload))
    assert caught.value.reason == ("length" if not payload else "codec")


def test_a_corrupted_split_payload_fails_its_checksum_before_decoding() -> None:
    stored = bytearray(b"".join(Compressor("zstd-split", element_bytes=4).frame(NAME, plain(bytes(N)))))
    stored[HEADER_SIZE + 3] ^= 0x10
    with pytest.raises(CorruptObjectError) as caught:
        placed(bytes(stored))
    assert caught.value.reason == "checksum"


def test_the_split_flag_without_zstd_is_a_header_miss() -> None:
    stored = bytearray(b"".join(plain(bytes(N))))
    stored[6] |= FLAG_SPLIT
    with pytest.raises(CorruptObjectError) as caught:
        unframe(bytes(stored), FP, N, name=NAME)
    assert caught.value.reason == "header"


def test_a_reader_that_knows_zstd_but_not_split_counts_a_split_frame_as_a_miss() -> None:
    """The framing module of the commit before the split codec, run on a split frame: a ``header`` miss."""
    old = framing_at(ZSTD_ONLY_COMMIT)
    assert old.KNOWN_FLAGS == 3  # it knows the MAC and zstd, nothing else
    stored = b"".join(Compressor("zstd-split", element_bytes=4).frame(NAME, plain(bytes(N))))
    with pytest.raises(old.CorruptObjectError) as caught:
        old.unframe(stored, FP, N, name=NAME)
    assert caught.value.reason == "header"
