"""Writing framed blocks to a store (used by the store worker half), in the cheapest way the store offers.

A store that lends writable space (``fill_many``, e.g. cpu_offload's pool) gets each frame written
straight into it: the payload is copied once and checksummed while it is still in the CPU cache,
then the header goes in front. Any other store gets a header and the payload pieces (``put_many``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

from kvdi.connectors.store.blockio import gather
from kvdi.connectors.store.framing import HEADER_SIZE, Buffer, FrameKey, frame_header
from kvdi.connectors.store.protocol import BlockStore, FillStore, StoreCapabilities

Pieces = list[list[memoryview]]  # each block's payload pieces (cache views, or its staged row)


class BlockWriter:
    """Frames blocks of one layout and builds the store call that writes them."""

    def __init__(
        self,
        store: BlockStore,
        caps: StoreCapabilities,
        fingerprint: bytes,
        block_bytes: int,
        key: FrameKey | None,
        log_once: Callable[..., None],
    ) -> None:
        self.store, self._fill_space = store, caps.fill
        self._fingerprint, self._key, self._log_once = fingerprint, key, log_once
        self._frame_bytes = HEADER_SIZE + block_bytes

    def call(self, pieces: Pieces, keys: Sequence[bytes]) -> Callable[[], object]:
        """The store call that writes block ``i`` (``pieces[i]``) under ``keys[i]``; it returns what the store
        returns (how many were written) and raises what the store raises."""
        if self._fill_space:
            fill = cast(FillStore, self.store).fill_many
            return partial(fill, [(k, self._frame_bytes) for k in keys], partial(self._fill, pieces, keys))
        items: list[tuple[bytes, Sequence[Buffer]]] = []
        for piece_list, key in zip(pieces, keys, strict=True):
            items.append((key, [frame_header(self._fingerprint, piece_list, self._key, name=key), *piece_list]))
        return partial(self.store.put_many, items)

    def _fill(self, pieces: Pieces, keys: Sequence[bytes], i: int, space: memoryview) -> bool:
        """Write block ``i``'s frame into ``space`` lent by the store: the payload, then its header. Never raises."""
        try:
            payload = space[HEADER_SIZE : self._frame_bytes]
            gather(pieces[i], payload)
            space[:HEADER_SIZE] = frame_header(self._fingerprint, payload, self._key, name=keys[i])
        except Exception as exc:
            self._log_once(f"fill:{type(exc).__name__}", "framing a block failed, not stored: %r", exc)
            return False
        return True


__all__ = ["BlockWriter", "Pieces"]
