"""The byte split of the dense codec (``compression=zstd-split``): a block's bytes grouped by their position
in the element before zstd, and put back after it.

KV is stored as 2- or 4-byte floats. In bf16 the high byte of each element (sign and most of the
exponent) takes few values, the low byte (mantissa) looks random: interleaved, zstd sees neither
pattern well; split (all high bytes, then all low bytes; for fp32 four runs), the exponent run
compresses far better while the mantissa run costs what it did. The same split the blosc2
"shuffle" filter does. Each run (a "plane": all bytes at one position) is its own zstd frame, so
zstd's entropy tables fit each plane (one frame over both planes of a block under 128 KiB shares a
table and gains little). The stored payload is ``[element size: 1 byte]`` then the planes' zstd
frames back to back; the reader decompresses across the frames into a buffer of exactly
``block_bytes`` (bounded as for plain zstd) and writes each element back into the destination pieces.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvdi.connectors.store.framing import Buffer, CorruptObjectError

SPLIT_ELEMENT_BYTES = (2, 4, 8)
"""Element sizes a split frame may declare; anything else is a ``codec`` miss."""


def split_bytes(payload: Sequence[Buffer], raw: int, element_bytes: int) -> list[memoryview]:
    """The ``raw`` bytes of ``payload`` (pieces back to back) as ``element_bytes`` planes: plane ``k`` holds byte
    ``k`` of every element, in order."""
    planes = np.empty((element_bytes, raw // element_bytes), dtype=np.uint8)
    offset = 0
    for piece in payload:
        view = np.frombuffer(memoryview(piece).cast("B"), dtype=np.uint8).reshape(-1, element_bytes)
        count = view.shape[0]
        for k in range(element_bytes):  # column copies: contiguous writes, far faster than a transposed copy
            planes[k, offset : offset + count] = view[:, k]
        offset += count
    return [memoryview(plane.data) for plane in planes]


def join_into(split: Buffer, pieces: Sequence[memoryview], element_bytes: int) -> None:
    """Undo :func:`split_bytes`: write the elements of ``split`` back, in order, into ``pieces``."""
    planes = np.frombuffer(memoryview(split).cast("B"), dtype=np.uint8).reshape(element_bytes, -1)
    room = sum(p.nbytes for p in pieces)
    if room != planes.size:
        raise CorruptObjectError("length", f"pieces of {room} B for a {planes.size} B payload")
    offset = 0
    for piece in pieces:
        dst = piece if piece.format == "B" else piece.cast("B")
        count = dst.nbytes // element_bytes
        if count * element_bytes != dst.nbytes:
            raise CorruptObjectError("codec", f"a piece of {dst.nbytes} B is not whole {element_bytes} B elements")
        elements = np.frombuffer(dst, dtype=np.uint8).reshape(count, element_bytes)
        for k in range(element_bytes):
            elements[:, k] = planes[k, offset : offset + count]
        offset += count


def element_size(payload: Buffer, block_bytes: int) -> int:
    """The element size a split payload declares (its first byte), checked against ``block_bytes``."""
    view = memoryview(payload).cast("B")
    size = int(view[0]) if view.nbytes else 0
    if size not in SPLIT_ELEMENT_BYTES or block_bytes % size:
        raise CorruptObjectError("codec", f"split frame declares {size} B elements for a {block_bytes} B block")
    return size


__all__ = ["SPLIT_ELEMENT_BYTES", "element_size", "join_into", "split_bytes"]
