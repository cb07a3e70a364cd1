"""The store worker half's fallback read (moved out of :mod:`.worker`): a chunk whose store call failed is read again
one object at a time, so the blocks before the bad one still load."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvdi.connectors.base import ConnectorStats
from kvdi.connectors.store.reads import read_chunk

if TYPE_CHECKING:
    from kvdi.connectors.store.blockio import CacheIO
    from kvdi.connectors.store.worker import StoreWorkerConnector


def load_one_by_one(
    worker: StoreWorkerConnector, io: CacheIO, ids: Sequence[int], keys: Sequence[bytes], stats: ConnectorStats
) -> int:
    """Read a failed chunk's objects singly into ``worker``'s cache; return how many leading ones are in place."""
    for i, (bid, key) in enumerate(zip(ids, keys, strict=True)):
        io.begin()
        try:
            chunk = read_chunk(worker.store, worker.capabilities, worker._place, io, (bid,), (key,))
        except OSError as exc:  # the medium failed (server gone, disk error): a load failure
            stats.load_failures += 1
            worker._log_once(f"oserror:{type(exc).__name__}", "loading KV failed, recomputing: %s", exc)
            return i
        except Exception as exc:
            stats.corrupt_dropped += 1
            worker._log_once(f"odd:{type(exc).__name__}", "dropping a stored block the store failed on: %r", exc)
            worker.discard(key)
            return i
        good = worker._verify(io, chunk, stats)
        io.finish()
        if not good:
            return i
    return len(ids)


__all__ = ["load_one_by_one"]
