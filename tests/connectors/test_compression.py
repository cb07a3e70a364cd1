"""Compressed frames (``compression`` = zstd | zstd-split | auto): the frame rules, and round trips on a real S3 and Redis server."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("zstandard")
torch = pytest.importorskip("torch")

from kvdi.connectors.store.codec import (  # noqa: E402
    Compressor,
    compressor_for,
    read_capabilities,
    unframe_into,
)
from kvdi.connectors.store.framing import (  # noqa: E402
    CODEC_FLAGS,
    FLAG_MAC,
    FLAG_ZSTD,
    HEADER_SIZE,
    CorruptObjectError,
    FrameKey,
    frame_codec,
    frame_header,
    unframe,
)
from kvdi.errors import ConfigError  # noqa: E402
from kvdi.layout import DTYPE_BYTES  # noqa: E402
from kvdi.testing.conformance import BLOCKS, KEYS, LAYOUT, Halves  # noqa: E402

FP = LAYOUT.fingerprint()
N = LAYOUT.block_bytes
NAME = KEYS[0]
ZEROS = bytes(N)
BASE_COMMIT = "7b0b6e8"  # the last commit whose reader knew no codec flag
ELEMENT = DTYPE_BYTES[LAYOUT.dtype]
FLAGS = {"zstd": FLAG_ZSTD, "zstd-split": CODEC_FLAGS}


def plain(payload: bytes, key: FrameKey | None = None) -> list[bytes]:
    return [frame_header(FP, payload, key, name=NAME), payload]


def placed(frame: bytes, key: FrameKey | None = None, cut: int = N // 2) -> bytes:
    """The block ``frame`` holds, placed into two pieces cut at ``cut``."""
    out = bytearray(N)
    unframe_into(frame, [memoryview(out)[:cut], memoryview(out)[cut:]], FP, N, key, name=NAME)
    return bytes(out)


def framing_at(commit: str) -> ModuleType:
    """kvdi's framing module as ``commit`` had it (the test skips in a checkout without it: a shallow clone)."""
    root = Path(__file__).resolve().parents[2]
    shown = subprocess.run(
        ["git", "show", f"{commit}:kvdi/connectors/store/framing.py"], cwd=root, capture_output=True, text=True
    )
    if shown.returncode != 0:
        pytest.skip(f"commit {commit} is not in this checkout (shallow clone?)")
    old = ModuleType(f"framing_{commit}")
    exec(compile(shown.stdout, f"framing_{commit}.py", "exec"), old.__dict__)
    return old


# -- the frame ---------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [None, FrameKey(b"k" * 32)], ids=["unkeyed", "mac"])
def test_a_compressible_block_is_stored_compressed_and_placed_back_exactly(key: FrameKey | None) -> None:
    pieces = Compressor("zstd", key).frame(NAME, plain(ZEROS, key))
    stored = b"".join(pieces)
    assert frame_codec(stored[:HEADER_SIZE]) == FLAG_ZSTD
    assert bool(stored[6] & FLAG_MAC) == (key is not None)
    assert len(stored) < HEADER_SIZE + N // 4
    assert placed(stored, key) == ZEROS


def test_auto_stores_random_bytes_plain_and_zeros_compressed() -> None:
    auto = Compressor("auto")
    noise = os.urandom(N)
    kept = auto.frame(NAME, plain(noise))
    assert b"".join(kept) == b"".join(plain(noise))  # the writer's frame, untouched
    squeezed = b"".join(auto.frame(NAME, plain(ZEROS)))
    assert frame_codec(squeezed[:HEADER_SIZE]) == FLAG_ZSTD
    assert (auto.plain_blocks, auto.compressed_blocks) == (1, 1)
    assert auto.raw_bytes == 2 * N and auto.stored_bytes < N + N // 4


def test_auto_keeps_a_block_plain_when_it_saves_less_than_a_tenth() -> None:
    """Zeros for 5 % of the block, noise for the rest: zstd saves about 5 %, below auto's bound, above zero."""
    payload = bytes(N // 20) + os.urandom(N - N // 20)
    assert frame_codec(b"".join(Compressor("zstd").frame(NAME, plain(payload)))[:HEADER_SIZE]) == FLAG_ZSTD
    assert frame_codec(b"".join(Compressor("auto").frame(NAME, plain(payload)))[:HEADER_SIZE]) == 0


def test_auto_judges_a_large_block_by_a_sample_of_its_middle_piece() -> None:
    """Three 128 KiB pieces, only the middle one noise: ``zstd`` compresses the block, ``auto`` trusts the sample."""
    piece = 128 << 10
    pieces: list[bytes] = [bytes(piece), os.urandom(piece), bytes(piece)]
    framed = [frame_header(FP, pieces, name=NAME), *pieces]
    assert frame_codec(b"".join(Compressor("zstd").frame(NAME, framed))[:HEADER_SIZE]) == FLAG_ZSTD
    assert b"".join(Compressor("auto").frame(NAME, framed)) == b"".join(framed)
    squeezable = [bytes(piece)] * 3
    framed = [frame_header(FP, squeezable, name=NAME), *squeezable]
    assert frame_codec(b"".join(Compressor("auto").frame(NAME, framed))[:HEADER_SIZE]) == FLAG_ZSTD


def test_zstd_never_stores_a_block_larger_than_it_was() -> None:
    noise = os.urandom(N)
    assert b"".join(Compressor("zstd").frame(NAME, plain(noise))) == b"".join(plain(noise))


def test_a_frame_macced_by_the_writer_stays_plain_for_a_store_without_the_key() -> None:
    key = FrameKey(b"k" * 32)
    assert b"".join(Compressor("zstd").frame(NAME, plain(ZEROS, key))) == b"".join(plain(ZEROS, key))


def test_a_corrupted_compressed_payload_fails_its_checksum_before_decoding() -> None:
    stored = bytearray(b"".join(Compressor("zstd").frame(NAME, plain(ZEROS))))
    stored[HEADER_SIZE + 5] ^= 0x40
    with pytest.raises(CorruptObjectError) as caught:
        placed(bytes(stored))
    assert caught.value.reason == "checksum"


@pytest.mark.parametrize(
    "payload",
    [
        b"\x28\xb5\x2f\xfd" + os.urandom(40),  # zstd magic, garbage after it
        b"not zstd at all",
        "short",  # a valid stream of one byte less than a block
        "long",  # a valid stream of one byte more
    ],
    ids=["garbage", "no-magic", "short", "long"],
)
def test_a_compressed_payload_that_does_not_decode_to_one_block_is_a_codec_miss(payload: Any) -> None:
    import zstandard

    if payload in ("short", "long"):
        size = N - 1 if payload == "short" else N + 1
        payload = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(size))
    stored = frame_header(FP, payload, name=NAME, codec=FLAG_ZSTD) + payload  # checksum valid: only the codec is off
    with pytest.raises(CorruptObjectError) as caught:
        placed(stored)
    assert caught.value.reason == "codec"


def test_a_compressed_frame_longer_than_a_block_is_a_length_miss() -> None:
    payload = os.urandom(N + 1)
    with pytest.raises(CorruptObjectError) as caught:
        unframe(frame_header(FP, payload, name=NAME, codec=FLAG_ZSTD) + payload, FP, N, name=NAME)
    assert caught.value.reason == "length"


def test_a_reader_without_the_codec_flag_counts_a_compressed_frame_as_a_miss() -> None:
    """The framing module of the commit before compression, run on a compressed frame: a ``header`` miss."""
    old = framing_at(BASE_COMMIT)
    stored = b"".join(Compressor("zstd").frame(NAME, plain(ZEROS)))
    with pytest.raises(old.CorruptObjectError) as caught:
        old.unframe(stored, FP, N, name=NAME)
    assert caught.value.reason == "header"
    assert bytes(old.unframe(b"".join(plain(ZEROS)), FP, N, name=NAME)) == ZEROS  # plain frames: unchanged


def test_without_zstandard_asking_for_it_is_one_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ConfigError, match=r"^KVDI_S3__COMPRESSION=zstd/zstd-split/auto needs the zstandard package"):
        compressor_for("auto", None, "KVDI_S3__COMPRESSION")
    assert compressor_for("none", None, "KVDI_S3__COMPRESSION") is None


def test_stores_without_compression_never_import_zstandard() -> None:
    code = (
        "import sys, kvdi.connectors.s3, kvdi.connectors.redis, kvdi.connectors.store.worker; "
        "sys.exit('zstandard' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], env={**os.environ}).returncode == 0


# -- real servers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("boto3")
    from tests.helpers.s3 import s3_server

    with s3_server() as url:
        yield url


@pytest.fixture
def stores(request: pytest.FixtureRequest) -> Iterator[Callable[[str, str], Any]]:
    """``open(kind, compression)``: an s3 store on a fresh bucket or a redis store on the test's server."""
    opened: list[Any] = []

    def open_(kind: str, compression: str) -> Any:
        if kind == "s3":
            from kvdi.connectors.s3 import S3BlockStore, S3Settings
            from tests.helpers.s3 import new_bucket

            endpoint = request.getfixturevalue("s3_endpoint")
            settings = S3Settings(bucket=new_bucket(endpoint), endpoint_url=endpoint, compression=compression)
            store: Any = S3BlockStore(settings, max_object_bytes=HEADER_SIZE + N + 64)
        else:
            pytest.importorskip("redis")
            from kvdi.connectors.redis import RedisBlockStore
            from kvdi.settings import RedisSettings

            server = request.getfixturevalue("redis_server")
            store = RedisBlockStore(RedisSettings(url=server.url, compression=compression), HEADER_SIZE + N + 64)
        store.compressor = compressor_for(compression, None, "compression", ELEMENT)
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


def stored_sizes(store: Any) -> list[int]:
    return [len(bytes(obj)) for obj in store.get_many(list(KEYS)) if obj is not None]


def _round_trip(store: Any, seed: int | None) -> tuple[Halves, Halves]:
    writer = Halves(store, seed=seed)
    writer.prefill()
    reader = Halves(store, seed=99)
    offered, errors = reader.prefill()
    assert offered == 16 and not errors
    for block in BLOCKS[:4]:
        for got, want in zip(reader.block(block), writer.block(block), strict=True):
            assert torch.equal(got, want)
    assert reader.worker.stats.loaded_blocks == 4
    return writer, reader


@pytest.mark.parametrize("kind", ["s3", "redis"])
@pytest.mark.parametrize("compression", ["none", "zstd", "zstd-split", "auto"])
@pytest.mark.parametrize("seed", [None, 3], ids=["zeros", "randn"])
def test_round_trip_per_codec(stores: Callable[[str, str], Any], kind: str, compression: str, seed: int | None) -> None:
    store = stores(kind, compression)
    _round_trip(store, seed)
    sizes = stored_sizes(store)
    assert len(sizes) == 4
    if compression == "none":
        assert sizes == [HEADER_SIZE + N] * 4
    elif seed is None:  # zeros: compressed whatever the mode
        assert max(sizes) < HEADER_SIZE + N // 4
    assert read_capabilities(store).read_into is False or compression == "none"
    if compression == "auto":  # the store told auto's rule how fast its writes went
        assert store.compressor.rule.link_bps is not None and store.compressor.rule.codec_bps is not None


@pytest.mark.parametrize("kind", ["s3", "redis"])
@pytest.mark.parametrize("codec", ["zstd", "zstd-split"])
def test_a_corrupted_compressed_object_is_a_counted_miss(
    stores: Callable[[str, str], Any], kind: str, codec: str
) -> None:
    store = stores(kind, codec)
    Halves(store, seed=None).prefill()
    first = bytearray(bytes(store.get_many([KEYS[0]])[0]))
    assert frame_codec(first[:HEADER_SIZE]) == FLAGS[codec]
    first[-3] ^= 0x01
    store.discard(KEYS[0])
    store.compressor = None  # plant the bytes as they are
    assert store.put_many([(KEYS[0], [bytes(first)])]) == 1
    reader = Halves(store, seed=99)
    offered, errors = reader.prefill()
    assert offered == 16 and errors  # offered on lookup (the object is there), then not loaded
    assert reader.worker.stats.corrupt_dropped == 1 and reader.worker.stats.loaded_blocks == 0


@pytest.mark.parametrize("kind", ["s3", "redis"])
@pytest.mark.parametrize("codec", ["zstd", "zstd-split"])
def test_a_plain_reader_loads_compressed_frames_from_a_compressing_writer(
    stores: Callable[[str, str], Any], kind: str, codec: str
) -> None:
    """An engine with compression ``none`` on the same store reads what a ``zstd`` engine wrote: s3 through
    get_many; Redis reads straight into the cache, finds an object shorter than a frame and reads it whole,
    never dropping another engine's block as corrupt."""
    store = stores(kind, codec)
    Halves(store, seed=None).prefill()
    store.compressor = None
    assert read_capabilities(store).read_into is (kind == "redis")
    reader = Halves(store, seed=99)
    assert reader.prefill() == (16, set())
    assert reader.worker.stats.loaded_blocks == 4 and reader.worker.stats.corrupt_dropped == 0
    assert len(stored_sizes(store)) == 4
