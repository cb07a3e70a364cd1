"""What a worker rank's stores add to Prometheus: blocks evicted and bytes held (vLLM-free).

:class:`StoreCounters` is a worker rank's :class:`~.counters.FleetCounters` plus two things its
stores tell: ``evicted_blocks`` (a counter: the objects a store's LRU or size cap removed, one
per rank slice, counted whether or not KV cache events are on) and ``store_bytes`` (a gauge per
store kind, ``host`` or ``disk``: bytes the store holds, for stores that declare
:class:`SizedStore`; sent when it changes). The observer (:mod:`.prom`) takes the largest
rank's ``store_bytes`` (ranks may share one store: a sum would count it twice).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvdi.connectors.store.protocol import StoreCapabilities
from kvdi.integrations.vllm.fleet.counters import FleetCounters


@runtime_checkable
class SizedStore(Protocol):
    """A store that knows how many bytes it holds (None: it does not know now)."""

    @property
    def stored_bytes(self) -> int | None: ...


class StoreCounters(FleetCounters):
    """A worker rank's Prometheus additions with its stores' evictions and sizes (see the module docstring)."""

    def __init__(self, role: str, rank: str, half: object, leaves: Sequence[object]) -> None:
        super().__init__(role, rank, half)
        self.evicted_blocks = 0
        self._reported_evicted = 0
        self._sized = [(StoreCapabilities.of(leaf).hit_source, leaf) for leaf in leaves if isinstance(leaf, SizedStore)]
        self._sizes: dict[str, float] = {}

    def evictions(self, queue: deque[bytes] | None) -> Callable[[bytes], None]:
        """The watcher for one store's ``watch_evictions``: counts each eviction, queues its key for events."""

        def evicted(key: bytes) -> None:
            self.evicted_blocks += 1  # one writer: the store's saving thread
            if queue is not None:
                queue.append(key)

        return evicted

    def entry(self, delta: dict[str, int | float] | None) -> dict[str, Any] | None:
        out = super().entry(delta) or {}
        evicted = self.evicted_blocks - self._reported_evicted
        if evicted:
            out[f"c|{self.role}|evicted_blocks"] = evicted
            self._reported_evicted += evicted
        for label, leaf in self._sized:
            size = leaf.stored_bytes
            if size is not None and self._sizes.get(label) != size:
                self._sizes[label] = float(size)
                out[f"g|{self.role}|{self.rank}|store_bytes|{label}"] = float(size)
        return out or None


__all__ = ["SizedStore", "StoreCounters"]
