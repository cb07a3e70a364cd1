"""The scheduler process's key-only view of a store that lives in the worker's memory (vLLM-free)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from kvdi.connectors.store.protocol import StoreCapabilities


class BlockIndex:
    """A :class:`~kvdi.connectors.store.BlockStore` of keys only, for the scheduler half of a process-local store.

    Holds the keys the worker reported stored, least recently used first, at most
    ``capacity`` (the worker's store capacity in blocks), and forgets keys the worker
    reported gone. When it is wrong (the pool evicted differently) the load fails, is
    reported, and vLLM recomputes: a lost hit, never wrong output.
    """

    hit_source = "host"  # it stands in for a worker's process-local store: host memory

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):  # the head of a chain ends most recently used, as in the pool
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self._keys:
            n += 1
        for key in reversed(keys[:n]):
            self._keys.move_to_end(key)
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [None] * len(keys)  # the scheduler half never reads payloads

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Any]]]) -> int:
        self.add([key for key, _ in items])
        return len(items)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def close(self) -> None:
        self._keys.clear()


def store_capacity_blocks(backend: object) -> int | None:
    """How many blocks ``backend`` holds at most, when it says so (``num_slots``), else None."""
    return StoreCapabilities.of(backend).num_slots
