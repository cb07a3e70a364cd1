"""What kvdi adds to each step's stats for Prometheus, beside its plain counters (vLLM-free).

vLLM sums a connector's per-step stats across worker ranks and the scheduler before one
``observe`` call per step (:mod:`.prom`). kvdi's plain counters (``{connector: {counter:
delta}}``) stay as they are for vLLM's log line and for :mod:`.stats`; this module adds one
entry, :data:`PROM_KEY`, that keeps what Prometheus needs and the sum would lose:

- ``c|<role>|<counter>``: counter deltas by the role that counted them (the scheduler and
  the worker both count ``load_failures``), including ``lookup_miss_blocks``;
- ``h|<role>|<counter>``: a list of per-step seconds (``load_seconds`` and ``save_seconds``
  of each step that moved any), concatenated across ranks;
- ``g|<role>|<rank>|<gauge>|<label>``: gauges by rank, sent only when they change (bytes in
  flight; a Redis node's breaker: 1 open, 0 otherwise), so the observer keeps the last value
  of each rank and sums them; with ``scheduler.load_deadline`` the scheduler's cost model estimates
  (:mod:`kvdi.connectors.store.deadline`: round trip, load throughput, prefill rate) are gauges too.

vLLM asks for stats every step. A breaker's gauge is read only when one of the store's breakers moved
(:class:`~kvdi.connectors.breaker.BreakerMoves`, counted by the breaker itself: opened on anyone's call, the
scheduler's lookups and the deadline's prober included, made the probe once its reset time passed, closed), so a
step with no counter moved, no miss and no breaker moved answers None without reading a breaker. A store whose
health no move count covers (:func:`breaker_moves`) has its breakers read every step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from kvdi.connectors.base import StoreHalf, WorkerGauges
from kvdi.connectors.breaker import BreakerMoves, CircuitBreaker
from kvdi.connectors.store.deadline import DeadlineRule
from kvdi.connectors.store.protocol import StoreCapabilities, health_checks

PROM_KEY = "kvdi/prom"
HISTOGRAM_COUNTERS = ("load_seconds", "save_seconds")


def breaker_states(checks: list[Callable[[], Mapping[str, bool]]]) -> dict[str, bool]:
    """Whether each node's circuit breaker is open, by node label, from a store tree's
    :meth:`~kvdi.connectors.store.HealthStore.health` checks (:func:`~kvdi.connectors.store.health_checks`)."""
    return {str(node): not serving for check in checks for node, serving in check().items()}


@runtime_checkable
class OneBreakerStore(Protocol):
    """A :class:`~kvdi.connectors.store.HealthStore` behind one circuit breaker (a Redis server, an S3 endpoint):
    its health is that breaker's, so it changes only when ``breaker.moves`` counts a move."""

    @property
    def breaker(self) -> CircuitBreaker: ...


@runtime_checkable
class BreakersStore(Protocol):
    """A :class:`~kvdi.connectors.store.HealthStore` of several breakers (a Redis Cluster's nodes): its health
    changes only when ``breaker_moves`` counts a move (a breaker's change of state, or a node met)."""

    breaker_moves: BreakerMoves


def breaker_moves(store: object) -> list[BreakerMoves] | None:
    """The move counts covering the health of ``store`` and of every store it is made of, found once; None when
    the health of one of them is covered by none (it is read at every report)."""
    caps = StoreCapabilities.of(store)
    found: list[BreakerMoves] = []
    if caps.health is not None:
        if isinstance(store, BreakersStore):
            found.append(store.breaker_moves)
        elif isinstance(store, OneBreakerStore) and isinstance(store.breaker, CircuitBreaker):
            found.append(store.breaker.moves)
        else:
            return None
    for part in caps.parts:
        more = breaker_moves(part)
        if more is None:
            return None
        found += more
    return found


class FleetCounters:
    """One connector half's additions for Prometheus: miss blocks, per-step seconds, gauges when changed.

    The half's gauges are what it declares: :class:`~kvdi.connectors.base.WorkerGauges` (bytes in flight and in
    prefetch staging) and its store's health (:class:`~kvdi.connectors.store.HealthStore`, of every part), found
    once here."""

    def __init__(self, role: str, rank: str, half: object = None) -> None:
        self.role = role
        self.rank = rank
        self.lookup_miss_blocks = 0
        self.reported_misses = 0
        self._gauges: dict[str, float] = {}
        self._gauged = half if isinstance(half, WorkerGauges) else None
        self._health = health_checks(half.store) if isinstance(half, StoreHalf) else []
        moves = breaker_moves(half.store) if self._health and isinstance(half, StoreHalf) else []
        self._moves = tuple(moves or ())  # read at each entry: the breakers are read only when their sum moved
        self.moves_seen = -1 if self._moves else 0  # their sum at the last read of the breakers (-1: never read)
        # The one move count covering every breaker (a Redis server's): the adapter reads it itself, no call made.
        self.moved_by = self._moves[0] if len(self._moves) == 1 else None
        rule = getattr(half, "deadline", None)
        self._deadline = rule if isinstance(rule, DeadlineRule) and rule.enabled else None
        # Gauges that move with no sign here: the deadline's estimates (the prober's thread), a store's health that no
        # move count covers. They are read at every entry.
        self._unsignalled = self._deadline is not None or (bool(self._health) and moves is None)
        self._polled = self._unsignalled or self._gauged is not None  # read every step (a subclass may know better)
        # No counter moved, no miss counted and (``moved_by``) no breaker moved since the last entry: this entry is
        # None (a subclass may add more).
        quiet_health = not self._health or (not self._polled and len(self._moves) == 1)
        due = self._gauged is not None or self._deadline is not None or not quiet_health
        self.unmoved_is_empty = type(self) is FleetCounters and not due

    def looked_up(self, prompt_tokens: int, num_computed_tokens: int, matched_tokens: int, block_size: int) -> None:
        """Count the blocks a lookup asked for and did not get (scheduler role)."""
        asked = max(prompt_tokens - 1, 0) // block_size - num_computed_tokens // block_size
        self.lookup_miss_blocks += max(asked - max(matched_tokens, 0) // block_size, 0)

    def entry(self, delta: dict[str, int | float] | None) -> dict[str, Any] | None:
        """The :data:`PROM_KEY` entry of this step (None when nothing changed: at once, with no gauge to read, when
        every gauge says when it moves and none did)."""
        moves = 0
        for counted in self._moves:  # read before the breakers: a move after this read is seen at the next entry
            moves += counted.count
        if not (delta or self._polled or self.lookup_miss_blocks != self.reported_misses or moves != self.moves_seen):
            return None
        self.moves_seen = moves
        return self._entry(delta)

    def _entry(self, delta: dict[str, int | float] | None) -> dict[str, Any] | None:
        """The entry, every gauge read (only those that changed are in it)."""
        out: dict[str, Any] = {}
        for name, value in (delta or {}).items():
            if name in HISTOGRAM_COUNTERS:
                out[f"h|{self.role}|{name}"] = [value]
            else:
                out[f"c|{self.role}|{name}"] = value
        misses = self.lookup_miss_blocks - self.reported_misses
        if misses:
            out[f"c|{self.role}|lookup_miss_blocks"] = misses
            self.reported_misses = self.lookup_miss_blocks
        for gauge, value in self._gauge_values().items():
            if self._gauges.get(gauge) != value:
                self._gauges[gauge] = value
                out[f"g|{self.role}|{self.rank}|{gauge}"] = value
        return out or None

    def _gauge_values(self) -> dict[str, float]:
        values: dict[str, float] = {}
        if self._gauged is not None:
            values["inflight_bytes|"] = float(self._gauged.inflight_bytes)
            staged = self._gauged.staged_bytes
            if staged is not None:
                values["prefetch_staged_bytes|"] = float(staged)
        if self._deadline is not None:
            model = self._deadline.model
            for gauge, value in (("deadline_rtt_seconds|", model.rtt.value),
                                 ("deadline_load_bytes_per_second|", model.throughput.value),
                                 ("deadline_prefill_tokens_per_second|", model.prefill.value)):  # fmt: skip
                if value is not None:
                    values[gauge] = float(value)
        for node, is_open in breaker_states(self._health).items():
            values[f"breaker_open|{node}"] = 1.0 if is_open else 0.0
        return values


def merge_entries(mine: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Two :data:`PROM_KEY` entries as one: counters summed, histogram lists joined, gauges by rank kept."""
    merged = dict(mine)
    for key, value in other.items():
        if key not in merged:
            merged[key] = list(value) if isinstance(value, list) else value
        elif key.startswith("h|"):
            merged[key] = [*merged[key], *value]
        elif key.startswith("g|"):
            merged[key] = value  # the later report of the same rank wins
        else:
            merged[key] = merged[key] + value
    return merged


__all__ = [
    "HISTOGRAM_COUNTERS",
    "PROM_KEY",
    "BreakersStore",
    "FleetCounters",
    "OneBreakerStore",
    "breaker_moves",
    "breaker_states",
    "merge_entries",
]
