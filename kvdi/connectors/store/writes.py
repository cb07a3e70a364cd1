"""Framing blocks for a store (used by the store worker half): a header, then the payload pieces.

The checksum (and the MAC with an integrity key) is computed on the thread that builds the call: the
engine thread for a synchronous save (or the thread before the I/O thread, so one chunk's checksums
overlap the previous chunk's writes), the save job's thread for an asynchronous one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from kvdi.connectors.store.framing import Buffer, FrameKey, frame_header
from kvdi.connectors.store.protocol import BlockStore

Pieces = list[list[memoryview]]  # each block's payload pieces (cache views, or its staged row)


class BlockWriter:
    """Frames blocks of one layout and builds the store call that writes them."""

    def __init__(self, store: BlockStore, fingerprint: bytes, key: FrameKey | None) -> None:
        self.store, self._fingerprint, self._key = store, fingerprint, key

    def call(self, pieces: Pieces, keys: Sequence[bytes]) -> Callable[[], object]:
        """The store call that writes block ``i`` (``pieces[i]``) under ``keys[i]``, framed now; it returns what
        the store returns (how many were written) and raises what the store raises."""
        items: list[tuple[bytes, Sequence[Buffer]]] = []
        for piece_list, key in zip(pieces, keys, strict=True):
            items.append((key, [frame_header(self._fingerprint, piece_list, self._key, name=key), *piece_list]))
        return partial(self.store.put_many, items)


__all__ = ["BlockWriter", "Pieces"]
