"""The canonical stored block: sections of a block that any TP/PP shape writes and reads (docs/stored-format.md).

A block's KV for the whole model is cut into a fixed grid of :class:`Section` s (``section_layers``
layers by ``section_heads`` KV heads); each section is one object, named by the block key and its
ranges, framed with a 128-byte self-describing header (:func:`frame_section` / :func:`open_section`)
whose fingerprint (:meth:`Geometry.fingerprint`) names the model, dtype, block size, head geometry,
grid and format version, never the parallel shape or the rank. :class:`RankPart` is one rank's
layers and heads and the heads it is the designated writer of (replicas: the lowest rank holding
them); :func:`write_plan` / :func:`read_plan` say which sections it writes and needs. The conversion
between an engine's block order and the payload order lives in :mod:`.canonical_convert`.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvdi.connectors.store.framing import MAGIC as PER_RANK_MAGIC
from kvdi.connectors.store.framing import Buffer, CorruptObjectError, FrameKey, checksum, name_field
from kvdi.errors import ConfigError
from kvdi.layout import DTYPE_BYTES

MAGIC = b"KVDC"
CANONICAL_VERSION = 3  # 3: sections in packs (2: one section an object; 1: order LKHTD): else a ``version`` miss
ORDER_LNHKD = 2  # payload order: layer, token, head, K/V, dim (vLLM's GPU block order: no conversion there)
FLAG_MAC = 1
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
_CHECKED = struct.Struct("<4sHH16s16s8I2B6xQ")  # what the checksum covers besides the payload (88 B)
_FIELDS = struct.Struct("<4sHH16s16s8I2B6xQQ")  # what the MAC covers besides the payload (96 B)
_HEADER = struct.Struct("<4sHH16s16s8I2B6xQQ32s")
HEADER_SIZE = _HEADER.size  # 128
CHECKED_SIZE = _CHECKED.size  # 88: the checksum follows
_NO_MAC = bytes(32)
FORMATS = ("per_rank", "canonical")

REASONS = ("magic", "old_format", "version", "header", "fingerprint", "name", "range", "geometry", "length")
"""Miss reasons of :func:`open_section` besides ``checksum`` and ``mac``."""


@dataclass(frozen=True)
class Section:
    """One cell of the grid: ``layer_count`` layers from ``layer_start`` by ``head_count`` KV heads from
    ``head_start`` (model-global indices)."""

    layer_start: int
    layer_count: int
    head_start: int
    head_count: int

    def key(self, block_key: bytes) -> bytes:
        """The object key of this section of the block ``block_key``."""
        h = hashlib.blake2b(block_key, digest_size=16, person=b"kvdi-canon-sect")
        h.update(f"L{self.layer_start}+{self.layer_count}H{self.head_start}+{self.head_count}".encode())
        return h.digest()


@dataclass(frozen=True)
class Geometry:
    """The whole model's block and the section grid: what every shape of a fleet agrees on.

    ``model_id`` is the model identity without the parallel shape or rank (the block format tag of
    vLLM's CPU backend stays: it names how a head's bytes are packed). ``section_layers`` = 0 means
    all layers in one section. Raises ValueError, naming the field, for a grid that does not divide.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    section_layers: int = 0
    section_heads: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype={self.dtype!r} is not a stored dtype; allowed: {', '.join(DTYPE_CODES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.section_layers < 0 or (self.section_layers and self.num_layers % self.section_layers):
            raise ValueError(
                f"section_layers={self.section_layers} must be 0 (all) or divide num_layers={self.num_layers}"
            )
        if self.section_heads <= 0 or self.num_kv_heads % self.section_heads:
            raise ValueError(
                f"section_heads={self.section_heads} must be positive and divide num_kv_heads={self.num_kv_heads}"
            )

    @property
    def layers_per_section(self) -> int:
        return self.section_layers or self.num_layers

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def section_bytes(self, section: Section) -> int:
        """Payload bytes of ``section``."""
        per_head = 2 * self.block_size * self.head_dim * self.elem_bytes
        return section.layer_count * section.head_count * per_head

    def sections(self) -> list[Section]:
        """Every section of the grid, layer-major."""
        ls, hs = self.layers_per_section, self.section_heads
        return [
            Section(lo, ls, ho, hs) for lo in range(0, self.num_layers, ls) for ho in range(0, self.num_kv_heads, hs)
        ]

    def fingerprint(self) -> bytes:
        """16 bytes naming model, dtype, geometry, grid and format version (never the shape or the rank)."""
        return _fingerprint(self)

    def _text(self) -> str:
        return "|".join(
            str(v)
            for v in (
                "canonical",
                self.model_id,
                self.dtype,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                self.layers_per_section,
                self.section_heads,
                CANONICAL_VERSION,
                ORDER_LNHKD,
            )
        )


@functools.lru_cache(maxsize=64)
def _fingerprint(geometry: Geometry) -> bytes:
    return hashlib.blake2b(geometry._text().encode(), digest_size=16).digest()


@dataclass(frozen=True)
class RankPart:
    """One rank's layers and KV heads (model-global), and the heads it writes (``write_count`` 0: none)."""

    layer_start: int
    layer_count: int
    head_start: int
    head_count: int
    write_start: int
    write_count: int

    @classmethod
    def of(
        cls, geometry: Geometry, tp_size: int = 1, tp_rank: int = 0, layers: tuple[int, int] | None = None
    ) -> RankPart:
        """The part of TP rank ``tp_rank`` of ``tp_size`` holding ``layers`` (start, count; None: all).

        With ``num_kv_heads >= tp_size`` each rank holds ``num_kv_heads // tp_size`` heads of its own;
        with fewer, rank ``r`` holds the replica of head ``r * num_kv_heads // tp_size`` (as vLLM
        shards them) and writes it only when it is the lowest rank holding it.
        """
        heads = geometry.num_kv_heads
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} must lie in [0, tp_size={tp_size})")
        if heads >= tp_size:
            if heads % tp_size:
                raise ValueError(f"tp_size={tp_size} must divide num_kv_heads={heads}")
            per = heads // tp_size
            start, count, writes = tp_rank * per, per, True
        else:
            if tp_size % heads:
                raise ValueError(f"num_kv_heads={heads} must divide tp_size={tp_size}")
            start, count = tp_rank * heads // tp_size, 1
            writes = tp_rank == min(r for r in range(tp_size) if r * heads // tp_size == start)
        lstart, lcount = layers if layers is not None else (0, geometry.num_layers)
        if lstart < 0 or lcount <= 0 or lstart + lcount > geometry.num_layers:
            raise ValueError(f"layers=({lstart}, {lcount}) must lie in the model's {geometry.num_layers} layers")
        return cls(lstart, lcount, start, count, start, count if writes else 0)


def _overlap(a0: int, an: int, b0: int, bn: int) -> bool:
    return a0 < b0 + bn and b0 < a0 + an


def write_plan(geometry: Geometry, part: RankPart) -> list[Section]:
    """The sections ``part`` writes: those within its layers and the heads it writes.

    Raises ConfigError, in one line, when the rank's layers or written heads are not whole sections
    (a section it cannot write alone would never be written by anyone).
    """
    if part.write_count == 0:
        return []
    ls, hs = geometry.layers_per_section, geometry.section_heads
    if part.layer_start % ls or part.layer_count % ls or part.write_start % hs or part.write_count % hs:
        raise ConfigError(
            f"canonical store: this rank's layers [{part.layer_start}, {part.layer_start + part.layer_count}) and "
            f"heads [{part.write_start}, {part.write_start + part.write_count}) are not whole sections of "
            f"{ls} layers x {hs} heads; set section_layers / section_heads to divide every rank's share"
        )
    return [
        s
        for s in geometry.sections()
        if part.layer_start <= s.layer_start < part.layer_start + part.layer_count
        and part.write_start <= s.head_start < part.write_start + part.write_count
    ]


def read_plan(geometry: Geometry, part: RankPart) -> list[Section]:
    """The sections ``part`` needs: every one overlapping its layers and its heads."""
    return [
        s
        for s in geometry.sections()
        if _overlap(s.layer_start, s.layer_count, part.layer_start, part.layer_count)
        and _overlap(s.head_start, s.head_count, part.head_start, part.head_count)
    ]


def _fields(geometry: Geometry, section: Section, name: Buffer, flags: int, length: int) -> tuple[object, ...]:
    g = geometry
    return (
        MAGIC, CANONICAL_VERSION, flags, g.fingerprint(), name_field(name),
        section.layer_start, section.layer_count, section.head_start, section.head_count,
        g.num_layers, g.num_kv_heads, g.head_dim, g.block_size, DTYPE_CODES[g.dtype], ORDER_LNHKD, length,
    )  # fmt: skip


def checked_fields(geometry: Geometry, section: Section, name: Buffer) -> bytes:
    """The first 88 bytes of an unkeyed header :func:`frame_section` writes (what its checksum covers besides the
    payload): a reader compares them whole, then checks the checksum (:func:`verify_section` tells why not)."""
    return _CHECKED.pack(*_fields(geometry, section, name, 0, geometry.section_bytes(section)))


def _pieces(payload: Buffer | Sequence[Buffer]) -> list[Buffer]:
    """A payload given whole or as pieces (e.g. one run of each layer's buffer), as pieces."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return [payload]
    return list(payload)


def frame_section(
    geometry: Geometry,
    section: Section,
    payload: Buffer | Sequence[Buffer],
    key: FrameKey | None = None,
    *,
    name: Buffer,
) -> bytes:
    """The 128-byte header to store before ``payload`` (the section in ``LNHKD`` order, whole or as a list of
    pieces stored back to back) under ``name``."""
    pieces = _pieces(payload)
    length = sum(memoryview(p).nbytes for p in pieces)
    if length != geometry.section_bytes(section):
        raise ValueError(f"payload of {length} B, section needs {geometry.section_bytes(section)} B")
    flags = 0 if key is None else FLAG_MAC
    checked = _CHECKED.pack(*_fields(geometry, section, name, flags, length))
    digest = checksum([*pieces, checked])
    if key is None:
        return _HEADER.pack(*_fields(geometry, section, name, flags, length), digest, _NO_MAC)
    mac = key.mac()
    for piece in pieces:
        mac.update(piece)
    mac.update(checked + digest.to_bytes(8, "little"))
    return _HEADER.pack(*_fields(geometry, section, name, flags, length), digest, mac.digest())


def open_section(
    buf: Buffer, geometry: Geometry, section: Section, key: FrameKey | None = None, *, name: Buffer
) -> memoryview:
    """The payload of a stored section (header and payload in one buffer), checked as :func:`verify_section` does."""
    view = memoryview(buf).cast("B")
    if view.nbytes >= 4 and bytes(view[:4]) == PER_RANK_MAGIC:
        raise CorruptObjectError("old_format", "a per-rank frame where a canonical section was expected")
    if view.nbytes < HEADER_SIZE:
        raise CorruptObjectError("length", f"object of {view.nbytes} B is shorter than a {HEADER_SIZE} B header")
    verify_section(view[:HEADER_SIZE], view[HEADER_SIZE:], geometry, section, key, name=name)
    return view[HEADER_SIZE:]


def verify_section(
    header: Buffer,
    payload: Buffer | Iterable[Buffer],
    geometry: Geometry,
    section: Section,
    key: FrameKey | None = None,
    *,
    name: Buffer,
    fingerprint: bytes | None = None,
) -> None:
    """Check a section read as its header and its payload (whole, or the pieces it was read into: any iterable,
    so ``kvdi store verify`` streams one through in bounded chunks): every header field against ``geometry``,
    ``section``, the object ``name`` and ``fingerprint`` (default: the geometry's), then the length, then the
    checksum (or the MAC), one pass over the payload.

    Raises :class:`~.framing.CorruptObjectError` with the first reason that applies; a per-rank
    frame (magic ``KVDI``) is reason ``old_format``.
    """
    view = memoryview(header).cast("B")
    _, _, flags, fp, stored_name, *rest = _unpack(view)
    ranges, geom, (dtype, order), length, digest, mac = rest[:4], rest[4:8], rest[8:10], rest[10], rest[11], rest[12]
    if flags & ~FLAG_MAC or order != ORDER_LNHKD or bool(flags & FLAG_MAC) == (mac == _NO_MAC):
        raise CorruptObjectError("header", f"flags {flags:#x} / order {order} / MAC field disagree")
    if fp != (geometry.fingerprint() if fingerprint is None else fingerprint):
        raise CorruptObjectError("fingerprint", "written for another model, dtype, geometry or grid")
    if stored_name != name_field(name):
        raise CorruptObjectError("name", "written for another block or section (copied or renamed in the store)")
    if tuple(ranges) != (section.layer_start, section.layer_count, section.head_start, section.head_count):
        raise CorruptObjectError("range", f"covers layers/heads {tuple(ranges)}, expected {section}")
    g = geometry
    if tuple(geom) != (g.num_layers, g.num_kv_heads, g.head_dim, g.block_size) or dtype != DTYPE_CODES[g.dtype]:
        raise CorruptObjectError("geometry", f"geometry {tuple(geom)} dtype {dtype} does not match this model")
    expected = geometry.section_bytes(section)
    if length != expected:
        raise CorruptObjectError("length", f"header says {length} B of payload, need {expected} B")
    h = xxhash.xxh3_64() if key is None else key.mac()
    got = 0
    for piece in [payload] if isinstance(payload, bytes | bytearray | memoryview) else payload:
        got += memoryview(piece).nbytes
        h.update(piece)
    if got != expected:
        raise CorruptObjectError("length", f"{got} B of payload, need {expected} B")
    if key is None:
        h.update(view[: _CHECKED.size])
        if h.intdigest() != digest:
            raise CorruptObjectError("checksum", "payload does not match its section checksum")
        return
    if not flags & FLAG_MAC:
        raise CorruptObjectError("mac", "section carries no MAC but an integrity key is set")
    h.update(view[: _FIELDS.size])
    if not hmac.compare_digest(h.digest(), bytes(mac)):
        raise CorruptObjectError("mac", "MAC does not verify under this integrity key (forged or other key)")


def _unpack(view: memoryview) -> tuple[Any, ...]:
    """A header's fields, once its magic and version are this kvdi's (else ``old_format``, ``magic``, ``version``)."""
    if bytes(view[:4]) == PER_RANK_MAGIC:
        raise CorruptObjectError("old_format", "a per-rank frame where a canonical section was expected")
    fields = _HEADER.unpack_from(view)
    if fields[0] != MAGIC:
        raise CorruptObjectError("magic", f"expected {MAGIC!r}, got {bytes(fields[0])!r}")
    if fields[1] != CANONICAL_VERSION:
        raise CorruptObjectError("version", f"canonical format version {fields[1]}, kvdi reads {CANONICAL_VERSION}")
    return fields


def declared_section(header: Buffer) -> tuple[bytes, Geometry, Section]:
    """The fingerprint, model geometry and grid (model id unknown: "") and section a header declares, to check a
    section against itself (``kvdi store verify``: a store holds every model's). CorruptObjectError as a load."""
    fields = _unpack(memoryview(header).cast("B"))
    (ls, lc, hs, hc), (nl, nh, hd, bs), dtype = fields[5:9], fields[9:13], fields[13]
    if lc <= 0 or hc <= 0 or ls % lc or hs % hc or ls + lc > nl or hs + hc > nh:
        raise CorruptObjectError("range", f"layers/heads {(ls, lc, hs, hc)} are no section of {nl} x {nh}")
    dtypes = {code: name for name, code in DTYPE_CODES.items()}
    try:
        g = Geometry("", nl, nh, hd, bs, dtypes.get(dtype, str(dtype)), section_layers=lc, section_heads=hc)
    except ValueError as exc:
        raise CorruptObjectError("geometry", str(exc)) from None
    return bytes(fields[3]), g, Section(ls, lc, hs, hc)


def section_identity(header: Buffer) -> tuple[int, bytes, bytes]:
    """The version, fingerprint and name field of a (128-byte) canonical header of any version (``kvdi store``)."""
    _, version, _, fp, stored_name = _HEADER.unpack_from(memoryview(header).cast("B"))[:5]
    return int(version), bytes(fp), bytes(stored_name)


def frame_kind(buf: Buffer) -> str:
    """``"canonical"``, ``"per_rank"`` or ``"other"`` by an object's magic (for ``kvdi store stats``)."""
    head = bytes(memoryview(buf).cast("B")[:4])
    return "canonical" if head == MAGIC else "per_rank" if head == PER_RANK_MAGIC else "other"


__all__ = [
    "CANONICAL_VERSION",
    "CHECKED_SIZE",
    "FORMATS",
    "HEADER_SIZE",
    "MAGIC",
    "REASONS",
    "Geometry",
    "RankPart",
    "Section",
    "checked_fields",
    "declared_section",
    "frame_kind",
    "frame_section",
    "open_section",
    "read_plan",
    "section_identity",
    "verify_section",
    "write_plan",
]
