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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvdi.connectors.base import StoreHalf, WorkerGauges
from kvdi.connectors.store.deadline import DeadlineRule
from kvdi.connectors.store.protocol import health_checks

PROM_KEY = "kvdi/prom"
HISTOGRAM_COUNTERS = ("load_seconds", "save_seconds")


def breaker_states(checks: list[Callable[[], Mapping[str, bool]]]) -> dict[str, bool]:
    """Whether each node's circuit breaker is open, by node label, from a store tree's
    :meth:`~kvdi.connectors.store.HealthStore.health` checks (:func:`~kvdi.connectors.store.health_checks`)."""
    return {str(node): not serving for check in checks for node, serving in check().items()}


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
        rule = getattr(half, "deadline", None)
        self._deadline = rule if isinstance(rule, DeadlineRule) and rule.enabled else None
        self._gauges_due = bool(self._gauged is not None or self._deadline is not None or self._health)
        # No counter moved, no miss counted since the last entry: this entry is None (a subclass may add more).
        self.unmoved_is_empty = type(self) is FleetCounters and not self._gauges_due

    def looked_up(self, prompt_tokens: int, num_computed_tokens: int, matched_tokens: int, block_size: int) -> None:
        """Count the blocks a lookup asked for and did not get (scheduler role)."""
        asked = max(prompt_tokens - 1, 0) // block_size - num_computed_tokens // block_size
        self.lookup_miss_blocks += max(asked - max(matched_tokens, 0) // block_size, 0)

    def entry(self, delta: dict[str, int | float] | None) -> dict[str, Any] | None:
        """The :data:`PROM_KEY` entry of this step (None when nothing changed: at once, with no gauge to read)."""
        if not (delta or self._gauges_due or self.lookup_miss_blocks != self.reported_misses):
            return None
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


__all__ = ["HISTOGRAM_COUNTERS", "PROM_KEY", "FleetCounters", "breaker_states", "merge_entries"]
