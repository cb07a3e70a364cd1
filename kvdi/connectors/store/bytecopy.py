"""Copies between a block's layer pieces and one contiguous run of bytes (a frame's payload, a staged row).

Byte-wise memoryview assignment: one ``memcpy`` per piece, with far less per-call overhead than a numpy
or torch copy (it matters: a block is tens of pieces, one per layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvdi.connectors.store.framing import Buffer


def scatter(src: Buffer | np.ndarray, pieces: Sequence[Buffer]) -> None:
    """Copy the contiguous bytes ``src`` into the writable ``pieces`` in order (``src`` holds at least their sum).

    Byte-wise memoryview assignment: one ``memcpy`` per piece with far less per-call overhead
    than a numpy copy (it matters: a block is tens of pieces, one per layer).
    """
    flat = (src.reshape(-1).view(np.uint8).data if isinstance(src, np.ndarray) else memoryview(src)).cast("B")
    offset = 0
    for piece in pieces:
        dst = piece if isinstance(piece, memoryview) and piece.format == "B" else memoryview(piece).cast("B")
        end = offset + dst.nbytes
        dst[:] = flat[offset:end]
        offset = end


def gather(pieces: Sequence[memoryview], dst: memoryview) -> None:
    """Copy the 1-D byte views ``pieces`` back to back into ``dst`` (which holds at least their sum)."""
    offset = 0
    for piece in pieces:
        end = offset + piece.nbytes
        dst[offset:end] = piece
        offset = end


__all__ = ["gather", "scatter"]
