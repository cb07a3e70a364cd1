"""What a worker rank's stores add to Prometheus: blocks evicted and bytes held (vLLM-free).

:class:`StoreCounters` is a worker rank's :class:`~.counters.FleetCounters` plus two things its
stores tell: ``evicted_blocks`` (a counter: the objects a store's LRU or size cap removed, one
per rank slice, counted whether or not KV cache events are on) and ``store_bytes`` (a gauge per
store kind, ``host`` or ``disk``: bytes the store holds, for stores that declare
:class:`SizedStore`; sent when it changes). The observer (:mod:`.prom`) takes the largest
rank's ``store_bytes`` (ranks may share one store: a sum would count it twice).

For the series of vLLM's offloading connector (:mod:`.offload_series`) it also sends, once,
``tier_info`` per store tier (``g|worker|<rank>|tier_info|<index>:<kind>|<store class>``) and,
for a store of one tier, that tier's share of the step's transfers
(``c|worker|tier_read_bytes|<tier>`` and the like: all of them).

vLLM asks for stats every step. A half that says when its gauges may move (:class:`GaugeEpoch`: the store worker
half bumps ``gauge_epoch`` when it binds work, while work is in flight and when it collects some) has them read only
then: a step with no counter moved, no eviction, and the same epoch as the last read answers None without reading a
gauge. Gauges are still current at every answer: each source but a breaker moves only through this rank's
transfers, and a breaker's gauge is read when one of the store's breakers moved (:class:`~.counters.FleetCounters`:
a breaker counts its own moves, whoever's call made them: the scheduler's lookups share the store in an in-process
engine, and an open breaker becomes the probe on the first call after its reset time).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvdi.connectors.store.protocol import StoreCapabilities
from kvdi.integrations.vllm.fleet.counters import FleetCounters
from kvdi.integrations.vllm.fleet.offload_series import TIER_COUNTERS, tier_labels


@runtime_checkable
class SizedStore(Protocol):
    """A store that knows how many bytes it holds (None: it does not know now)."""

    @property
    def stored_bytes(self) -> int | None: ...


@runtime_checkable
class GaugeEpoch(Protocol):
    """A worker half whose gauges (and its stores' sizes; breakers count their own moves) move only when
    ``gauge_epoch`` changed."""

    gauge_epoch: int


class StoreCounters(FleetCounters):
    """A worker rank's Prometheus additions with its stores' evictions and sizes (see the module docstring)."""

    def __init__(self, role: str, rank: str, half: object, leaves: Sequence[object]) -> None:
        super().__init__(role, rank, half)
        self.evicted_blocks = 0
        self._reported_evicted = 0
        self._sized = [(StoreCapabilities.of(leaf).hit_source, leaf) for leaf in leaves if isinstance(leaf, SizedStore)]
        self._sizes: dict[str, float] = {}
        names = tier_labels(StoreCapabilities.of(leaf).hit_source for leaf in leaves)
        self._tiers = [(tier, type(leaf).__name__) for tier, leaf in zip(names, leaves, strict=True)]
        self._tiers_sent = False
        self._epochs = half if isinstance(half, GaugeEpoch) else None
        self._epoch = -1  # the half's epoch at the last read of the gauges
        # Nothing to read on a quiet step: the half says when its gauges and sizes move (or it has none), and the
        # breakers' moves are counted (:class:`~.counters.FleetCounters`).
        has_epoch = self._epochs is not None or (self._gauged is None and not self._sized)
        self._skips_quiet = has_epoch and not self._unsignalled

    def evictions(self, queue: deque[bytes] | None) -> Callable[[bytes], None]:
        """The watcher for one store's ``watch_evictions``: counts each eviction, queues its key for events."""

        def evicted(key: bytes) -> None:
            self.evicted_blocks += 1  # one writer: the store's saving thread
            if queue is not None:
                queue.append(key)

        return evicted

    def entry(self, delta: dict[str, int | float] | None) -> dict[str, Any] | None:
        """This step's :data:`~.counters.PROM_KEY` entry; None at once on a quiet step (see the module docstring)."""
        epochs = self._epochs
        moves = 0
        for counted in self._moves:  # read before the breakers: a move after this read is seen at the next entry
            moves += counted.count
        if (
            not delta
            and self._skips_quiet
            and self._tiers_sent
            and self.evicted_blocks == self._reported_evicted
            and self.lookup_miss_blocks == self.reported_misses
            and (epochs is None or epochs.gauge_epoch == self._epoch)
            and moves == self.moves_seen
        ):
            return None
        if epochs is not None:
            self._epoch = epochs.gauge_epoch
        self.moves_seen = moves
        out = self._entry(delta) or {}
        evicted = self.evicted_blocks - self._reported_evicted
        if evicted:
            out[f"c|{self.role}|evicted_blocks"] = evicted
            self._reported_evicted += evicted
        for label, leaf in self._sized:
            size = leaf.stored_bytes
            if size is not None and self._sizes.get(label) != size:
                self._sizes[label] = float(size)
                out[f"g|{self.role}|{self.rank}|store_bytes|{label}"] = float(size)
        self._tier_entries(out, delta)
        return out or None

    def _tier_entries(self, out: dict[str, Any], delta: dict[str, int | float] | None) -> None:
        """The tiers' descriptions (first call only) and, for a store of one tier, the step's transfers by tier."""
        if not self._tiers_sent:
            self._tiers_sent = True
            for tier, store in self._tiers:
                out[f"g|{self.role}|{self.rank}|tier_info|{tier}|{store}"] = 1.0
        if len(self._tiers) == 1 and delta:
            tier = self._tiers[0][0]
            for name, per_tier in TIER_COUNTERS.items():
                if delta.get(name):
                    out[f"c|{self.role}|{per_tier}|{tier}"] = delta[name]


__all__ = ["GaugeEpoch", "SizedStore", "StoreCounters"]
