"""Lossless compression of stored frames for network and object stores (``compression`` = none | zstd |
zstd-split | auto).

A store whose ``compression`` is set re-frames each block it is about to write
(:class:`Compressor`): the payload becomes one zstd frame (level 1: the fast end; KV of real models
compresses by its exponent bytes, which level 1 already finds), the header gets
:data:`~.framing.FLAG_ZSTD` and a checksum (and, with an integrity key, a MAC) over the compressed
bytes. ``zstd`` keeps every block that got smaller; ``auto`` keeps a block compressed only when that
saves at least :data:`AUTO_MIN_SAVING` and, once measured, when the link time it saves exceeds the
time compressing costs (:mod:`.codec_auto`: running estimates of the codec's speed and ratio and of
the store's write throughput, which the store reports with :meth:`Compressor.link_sample`); it
stores the rest as they are (a block of 256 KiB or more is judged by a 64 KiB sample first, so
random-looking KV costs a sample's compression on save and nothing at read time). ``zstd-split`` is
the dense codec: the block's bytes are first grouped by their position in the layout's element
(:mod:`.codec_split`: for bf16 all high bytes, then all low bytes) and the frame gets
:data:`~.framing.FLAG_SPLIT` too. Either way a block never grows, so an object stays within one
frame's read bound.

Any reader places a compressed frame (:func:`unframe_into`): the checksum or MAC is checked over
the stored bytes first, then zstd decompresses straight into the destination pieces, reading at
most ``block_bytes + 1`` bytes of output; a stream that ends early, runs long or does not decode is
:class:`~.framing.CorruptObjectError` ``codec`` (a counted miss). The ``zstandard`` package is
imported only when a store asks for compression or a compressed frame is read.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

from kvdi.connectors.store.codec_auto import LinkRule
from kvdi.connectors.store.codec_split import element_size, join_into, split_bytes
from kvdi.connectors.store.framing import (
    CODEC_FLAGS,
    FLAG_MAC,
    FLAG_SPLIT,
    FLAG_ZSTD,
    HEADER_SIZE,
    MAGIC,
    Buffer,
    CorruptObjectError,
    FrameKey,
    frame_codec,
    frame_header,
    unframe,
)
from kvdi.connectors.store.protocol import BlockStore, StoreCapabilities, leaf_stores
from kvdi.errors import ConfigError

Compression = Literal["none", "zstd", "zstd-split", "auto"]
COMPRESSIONS: tuple[str, ...] = ("none", "zstd", "zstd-split", "auto")
CODECS = ("zstd", "zstd-split", "auto")
AUTO_MIN_SAVING = 0.10
"""``auto`` stores a block compressed only when that saves at least this fraction of its bytes."""
ZSTD_LEVEL = 1
SAMPLE_BYTES = 64 << 10
"""``auto`` compresses this much of a large block first; a block whose sample saves under the bound stays plain."""
SAMPLE_FROM_BYTES = 256 << 10  # blocks of at least this size are sampled first

_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread


def zstd_module(option: str = "compression") -> Any:
    """The ``zstandard`` module, or a one-line ConfigError naming ``option`` when it is not installed."""
    try:
        import zstandard
    except ImportError:
        raise ConfigError(
            f"{option}=zstd/zstd-split/auto needs the zstandard package, which is not installed "
            "(pip install zstandard, or kvdi's s3 / redis extra); or set it to none"
        ) from None
    return zstandard


def _contexts() -> tuple[Any, Any]:
    pair: tuple[Any, Any] | None = getattr(_local, "pair", None)
    if pair is None:
        zstd = zstd_module()
        pair = _local.pair = (zstd.ZstdCompressor(level=ZSTD_LEVEL), zstd.ZstdDecompressor())
    return pair


class Compressor:
    """Re-frames blocks compressed for one store (``mode`` ``zstd``, ``zstd-split`` or ``auto``); counts what
    it stored.

    ``key`` is the engine's integrity key (``KVDI_INTEGRITY_KEY``): a frame the writer MACed is
    MACed again over its compressed bytes (without the key such a frame is stored as it is).
    ``element_bytes`` is the layout's dtype size, the split of ``zstd-split`` (1: plain zstd).
    """

    def __init__(
        self, mode: Compression, key: FrameKey | None = None, option: str = "compression", element_bytes: int = 2
    ) -> None:
        if mode not in CODECS:
            raise ConfigError(f"{option}={mode!r} is not a codec; allowed: {', '.join(CODECS)} (none: no Compressor)")
        zstd_module(option)  # fail at start, with the option's name, not at the first save
        self.mode = mode
        self._key = key
        self._split = element_bytes if mode == "zstd-split" and element_bytes > 1 else 0
        self._min_saving = AUTO_MIN_SAVING if mode == "auto" else 0.0
        self._lock = threading.Lock()
        self.raw_bytes = 0
        """Payload bytes handed to :meth:`frame` (plain size)."""
        self.stored_bytes = 0
        """Payload bytes written for them (compressed or plain)."""
        self.compressed_blocks = 0
        self.plain_blocks = 0
        self.rule = LinkRule(AUTO_MIN_SAVING, label=option) if mode == "auto" else None
        """``auto``'s running estimates and decisions (:mod:`.codec_auto`); None for the other codecs."""

    def __repr__(self) -> str:
        return f"Compressor({self.mode!r})"

    def frame(self, key: bytes, pieces: Sequence[Buffer]) -> Sequence[Buffer]:
        """``pieces`` (a header, then the payload) re-framed compressed when that pays, else ``pieces`` as they are."""
        header = memoryview(pieces[0]).cast("B") if pieces else memoryview(b"")
        if header.nbytes != HEADER_SIZE or header[:4] != MAGIC or header[6] & ~FLAG_MAC or header[7]:
            return pieces  # not a plain frame of ours (already compressed, or foreign): stored as given
        mac = bool(header[6] & FLAG_MAC)
        payload = pieces[1:]
        raw = sum(memoryview(p).nbytes for p in payload)
        split = bool(self._split) and raw % self._split == 0  # a block of whole elements (always, from a layout)
        packed = None
        if raw and (self._key is not None or not mac):
            packed = self._pack(payload, raw, split) if self.rule is None else self._auto(payload, raw)
        if packed is None or len(packed) > raw * (1 - self._min_saving) or len(packed) >= raw:
            self._count(raw, raw, False)
            return pieces
        self._count(raw, len(packed), True)
        fingerprint = bytes(header[8:24])
        codec = CODEC_FLAGS if split else FLAG_ZSTD
        new = frame_header(fingerprint, packed, self._key if mac else None, name=key, codec=codec)
        return [new, packed]

    def frame_all(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> list[tuple[bytes, Sequence[Buffer]]]:
        """:meth:`frame` for each ``(key, pieces)`` of a ``put_many``."""
        return [(key, self.frame(key, pieces)) for key, pieces in items]

    def link_sample(self, nbytes: int, seconds: float) -> None:
        """The store wrote ``nbytes`` (as stored) in one request of ``seconds``: ``auto``'s link estimate."""
        if self.rule is not None:
            self.rule.link_sample(nbytes, seconds)

    def _auto(self, payload: Sequence[Buffer], raw: int) -> bytes | None:
        """``auto``: the compressed payload when :class:`~.codec_auto.LinkRule` says it pays, else None. A large
        block is judged by a sample (:data:`SAMPLE_BYTES` of its middle piece), so an incompressible block costs
        a sample's compression, not the block's; a small one is compressed whole. Both feed the estimates."""
        assert self.rule is not None
        if self.rule.skips_sample():
            return None
        if raw < SAMPLE_FROM_BYTES:
            packed = self._timed(payload, raw)
            return packed if self.rule.decide(len(packed) <= raw * (1 - self._min_saving)) else None
        piece = memoryview(payload[len(payload) // 2]).cast("B")
        sample = piece[: min(SAMPLE_BYTES, piece.nbytes)]
        packed = self._timed([sample], sample.nbytes)
        saves = len(packed) <= sample.nbytes * (1 - self._min_saving)
        return self._timed(payload, raw) if self.rule.decide(saves) else None

    def _timed(self, payload: Sequence[Buffer], raw: int) -> bytes:
        assert self.rule is not None
        started = time.perf_counter()
        packed = self._compress(payload, raw)
        self.rule.codec_sample(raw, len(packed), time.perf_counter() - started)
        return packed

    def _pack(self, payload: Sequence[Buffer], raw: int, split: bool) -> bytes:
        """The stored payload: zstd of the block, or (``split``) the element size then zstd of each byte plane."""
        if not split:
            return self._compress(payload, raw)
        planes = split_bytes(payload, raw, self._split)  # one zstd frame per plane: each gets its own tables
        return b"".join([bytes([self._split]), *map(_contexts()[0].compress, planes)])

    @staticmethod
    def _compress(payload: Sequence[Buffer], raw: int) -> bytes:
        compressor = _contexts()[0]
        if len(payload) == 1:
            return bytes(compressor.compress(payload[0]))
        stream = compressor.compressobj(size=raw)  # the content size goes into the zstd frame
        parts = [stream.compress(p) for p in payload]
        parts.append(stream.flush())
        return b"".join(parts)

    def _count(self, raw: int, stored: int, compressed: bool) -> None:
        with self._lock:
            self.raw_bytes += raw
            self.stored_bytes += stored
            if compressed:
                self.compressed_blocks += 1
            else:
                self.plain_blocks += 1


def compressor_for(mode: str, key: FrameKey | None, option: str, element_bytes: int = 2) -> Compressor | None:
    """The :class:`Compressor` of a store's ``compression`` setting (``option`` names it), None for ``none``;
    ``element_bytes``: the layout's dtype size (``DTYPE_BYTES[layout.dtype]``), what ``zstd-split`` splits by."""
    if mode == "none":
        return None
    if mode not in COMPRESSIONS:
        raise ConfigError(f"{option}={mode!r} is not allowed; allowed: {', '.join(COMPRESSIONS)}")
    return Compressor(mode, key, option, element_bytes)  # type: ignore[arg-type]


def decompress_into(stored: Buffer, pieces: Sequence[memoryview], block_bytes: int, frames: bool = False) -> None:
    """Decompress the zstd frame ``stored`` (``frames``: the zstd frames back to back, a split payload's planes)
    straight into ``pieces`` (``block_bytes`` in all, in order).

    Output is bounded: at most ``block_bytes + 1`` bytes are ever produced. Raises CorruptObjectError
    ``codec`` unless it decodes to exactly ``block_bytes``.
    """
    zstd = zstd_module()
    room = sum(p.nbytes for p in pieces)
    if room != block_bytes:
        raise CorruptObjectError("length", f"pieces of {room} B for a {block_bytes} B payload")
    try:
        declared = -1 if frames else zstd.frame_content_size(stored)
        if declared not in (block_bytes, -1):  # -1: the writer did not record it
            raise CorruptObjectError("codec", f"compressed block says {declared} B, layout needs {block_bytes} B")
        reader = _contexts()[1].stream_reader(stored, read_across_frames=frames)
        with reader:
            for piece in pieces:
                dst = piece if piece.format == "B" else piece.cast("B")
                done = 0
                while done < dst.nbytes:
                    got = reader.readinto(dst[done:])
                    if not got:
                        raise CorruptObjectError("codec", f"compressed block ends early ({block_bytes} B expected)")
                    done += got
            if reader.read(1):
                raise CorruptObjectError("codec", f"compressed block decodes to more than {block_bytes} B")
    except zstd.ZstdError as exc:
        raise CorruptObjectError("codec", f"compressed block does not decode ({exc})") from None


def scatter_bytes(src: memoryview, pieces: Sequence[memoryview]) -> None:
    """Copy ``src`` into ``pieces`` in order (one memcpy per piece)."""
    offset = 0
    for piece in pieces:
        dst = piece if piece.format == "B" else piece.cast("B")
        dst[:] = src[offset : offset + dst.nbytes]
        offset += dst.nbytes


def unframe_into(
    buf: Buffer,
    pieces: Sequence[memoryview],
    fingerprint: bytes,
    block_bytes: int,
    key: FrameKey | None = None,
    *,
    name: Buffer,
) -> None:
    """Check the whole frame ``buf`` of block ``name`` (:func:`~.framing.unframe`) and place its payload into
    ``pieces``: copied, or decompressed there when the frame is compressed. Raises CorruptObjectError."""
    payload = unframe(buf, fingerprint, block_bytes, key, name=name)
    codec = frame_codec(memoryview(buf)[:HEADER_SIZE])
    if codec & FLAG_SPLIT:
        size = element_size(payload, block_bytes)
        split = bytearray(block_bytes)
        decompress_into(payload[1:], [memoryview(split)], block_bytes, frames=True)
        join_into(split, pieces, size)
    elif codec:
        decompress_into(payload, pieces, block_bytes)
    else:
        scatter_bytes(payload, pieces)


def compresses(store: BlockStore) -> bool:
    """Whether ``store`` (or any store it is made of) writes compressed frames (its ``compressor`` is set)."""
    return any(getattr(leaf, "compressor", None) is not None for leaf in leaf_stores(store))


def read_capabilities(store: BlockStore) -> StoreCapabilities:
    """:meth:`StoreCapabilities.of` ``store``, for the worker: a store that writes compressed frames is read
    whole (``get_many``) and decompressed, never straight into the cache (its objects are not frame-sized)."""
    caps = StoreCapabilities.of(store)
    return dataclasses.replace(caps, read_into=False) if caps.read_into and compresses(store) else caps


__all__ = [
    "AUTO_MIN_SAVING",
    "CODECS",
    "COMPRESSIONS",
    "Compression",
    "Compressor",
    "compresses",
    "compressor_for",
    "decompress_into",
    "read_capabilities",
    "scatter_bytes",
    "unframe_into",
    "zstd_module",
]
