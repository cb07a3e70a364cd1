"""Framing blocks for a store (used by the store worker half): a header, then the payload pieces.

The checksum (and the MAC with an integrity key) is computed on the thread that builds the call: the
engine thread for a synchronous save (or the thread before the I/O thread, so one chunk's checksums
overlap the previous chunk's writes), the save job's thread for an asynchronous one.

Saves from a CPU cache go to the store about :data:`~.worker.CHUNK_BYTES` at a time, except to a store
that writes each object with its own request on a pool (S3: ``save_batch_blocks``): one ``put_many``
of a few blocks keeps most of its connections idle, so such a store gets batches of the size it asks
for (:func:`save_batch_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from kvdi.connectors.base import ConnectorStats
from kvdi.connectors.store.framing import Buffer, FrameKey, frame_header
from kvdi.connectors.store.protocol import BlockStore, leaf_stores, written_count

Pieces = list[list[memoryview]]  # each block's payload pieces (cache views, or its staged row)
MAX_SAVE_BATCH_BLOCKS = 4096


def save_batch_blocks(store: BlockStore) -> int:
    """The most blocks any part of ``store`` asks to get per ``put_many`` (its ``save_batch_blocks``), or 0."""
    asked = [getattr(leaf, "save_batch_blocks", 0) for leaf in leaf_stores(store)]
    valid = [n for n in asked if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return min(max(valid, default=0), MAX_SAVE_BATCH_BLOCKS)


class BlockWriter:
    """Frames blocks of one layout, builds the store call that writes them, and counts what it wrote."""

    def __init__(
        self,
        store: BlockStore,
        fingerprint: bytes,
        key: FrameKey | None,
        block_bytes: int = 0,
        log_once: Callable[..., None] | None = None,
    ) -> None:
        self.store, self._fingerprint, self._key = store, fingerprint, key
        saved = getattr(store, "saved_block_bytes", None)  # canonical: this rank's sections only (0: replicas)
        self.block_bytes = saved if isinstance(saved, int) else block_bytes
        self._framed = getattr(store, "reads_frame_headers", True) is not False  # canonical: sections, no frame
        self._log_once = log_once
        self.block_event: Callable[[bool, bytes], None] | None = None  # KV cache events: a block was stored

    def call(self, pieces: Pieces, keys: Sequence[bytes]) -> Callable[[], object]:
        """The store call that writes block ``i`` (``pieces[i]``) under ``keys[i]``, framed now; it returns what
        the store returns (how many were written) and raises what the store raises."""
        items: list[tuple[bytes, Sequence[Buffer]]] = []
        for piece_list, key in zip(pieces, keys, strict=True):
            header = frame_header(self._fingerprint, piece_list, self._key, name=key) if self._framed else b""
            items.append((key, [header, *piece_list]))
        return partial(self.store.put_many, items)

    def settle(self, stats: ConnectorStats, count: int, finish: Callable[[], object], keys: Sequence[bytes]) -> None:
        """Run or wait for one put_many of ``count`` blocks and count the outcome; nothing is ever raised."""
        try:
            written = written_count(finish(), count)
        except Exception as exc:
            stats.save_failures += count
            self._log(f"save:{type(exc).__name__}", "saving KV failed, blocks not stored: %r", exc)
            return
        if written < count:
            self._log("save:partial", "the store wrote %d of %d blocks", written, count)
        stats.save_failures += count - written
        if self.block_event is not None and written == count:  # which of a partial batch landed is unknown
            for key in keys:
                self.block_event(True, key)
        stats.saved_blocks += written
        stats.saved_bytes += written * self.block_bytes

    def _log(self, reason: str, message: str, *args: object) -> None:
        if self._log_once is not None:
            self._log_once(reason, message, *args)


__all__ = ["MAX_SAVE_BATCH_BLOCKS", "BlockWriter", "Pieces", "save_batch_blocks"]
