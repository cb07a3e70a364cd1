"""kvdi's counters as Prometheus series on ``vllm serve``'s ``/metrics`` (imports vLLM).

vLLM builds :class:`KvdiPromMetrics` once per API server through
``KvdiConnector.build_prom_metrics`` and calls :meth:`KvdiPromMetrics.observe` with each
step's stats, summed across worker ranks and the scheduler (:class:`FleetConnectorStats`).
Series follow vLLM's conventions (``vllm:`` prefix, counters exposed with ``_total``, vLLM's
``model_name`` and ``engine`` labels first) and add ``connector`` (the registered name) and
``role`` (``scheduler`` or ``worker``, the half that counted). Names put the unit last
(``_bytes``, ``_seconds``, ``_blocks``). Every counter, histogram and unlabelled gauge has a
sample at 0 for both roles from the moment the server starts, so ``rate()`` and alerts work
before anything moved. See :data:`COUNTERS`, :data:`HISTOGRAMS`, :data:`GAUGES` for the list.

The same counters also go out under the names of vLLM's own offloading connector
(``vllm:kv_offload_config_info``, ``vllm:kv_offload_{load,store}_*``,
``vllm:kv_offload_tiering_*`` by ``tier``), so a dashboard built for it shows kvdi's tiers
(:mod:`.offload_series`: from the first step on, and left to vLLM's connector where it runs too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger

from kvdi.integrations.vllm.envelopes import KvdiConnectorStats
from kvdi.integrations.vllm.fleet.counters import PROM_KEY, merge_entries
from kvdi.integrations.vllm.fleet.offload_series import OffloadSeries

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram

logger = init_logger(f"vllm.{__name__}")

COUNTERS: dict[str, tuple[str, str]] = {
    "lookups": ("vllm:kvdi_lookups", "Requests kvdi looked up in its store."),
    "lookup_hit_blocks": ("vllm:kvdi_hit_blocks", "Blocks kvdi's store held beyond vLLM's own prefix cache."),
    "lookup_miss_blocks": ("vllm:kvdi_miss_blocks", "Blocks looked up in kvdi's store and not found."),
    "loaded_blocks": ("vllm:kvdi_loaded_blocks", "Blocks loaded from kvdi's store into the KV cache."),
    "loaded_bytes": ("vllm:kvdi_loaded_bytes", "Bytes loaded from kvdi's store (payload, one rank's slice each)."),
    "saved_blocks": ("vllm:kvdi_saved_blocks", "Blocks written to kvdi's store (landed, not queued)."),
    "saved_bytes": ("vllm:kvdi_saved_bytes", "Bytes written to kvdi's store (payload)."),
    "corrupt_dropped": ("vllm:kvdi_corrupt_dropped", "Stored objects that failed verification and were dropped."),
    "load_failures": ("vllm:kvdi_load_failures", "Lookups or loads the store failed (treated as misses)."),
    "save_failures": ("vllm:kvdi_save_failures", "Blocks the store failed to write."),
    "async_load_requests": ("vllm:kvdi_async_load_requests", "Requests that waited for an asynchronous load."),
    "evicted_blocks": (
        "vllm:kvdi_evicted_blocks",
        "Objects kvdi's stores evicted (LRU or size cap; one per rank slice).",
    ),
    "lookups_skipped": (
        "vllm:kvdi_deadline_lookups_skipped",
        "Lookups not made: their round trip costs more than recompute.",
    ),
    "deadline_refused": ("vllm:kvdi_deadline_refused", "Hits not offered: loading them costs more than recompute."),
    "deadline_recomputes": ("vllm:kvdi_deadline_recomputes", "Prefetches or lookups past their deadline, recomputed."),
    "deadline_probes": (
        "vllm:kvdi_deadline_probes",
        "Background round-trip probes of a store whose lookups are skipped.",
    ),
}
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "load_seconds": ("vllm:kvdi_load_seconds", "Seconds kvdi spent loading in one engine step (steps that loaded)."),
    "save_seconds": ("vllm:kvdi_save_seconds", "Seconds kvdi spent saving or queueing saves in one engine step."),
}
GAUGES: dict[str, tuple[str, str, list[str]]] = {
    "inflight_bytes": ("vllm:kvdi_in_flight_bytes", "Bytes of queued asynchronous saves, all ranks.", []),
    "prefetch_staged_bytes": (
        "vllm:kvdi_prefetch_staged_bytes",
        "Host staging held by prefetches at lookup (transfer.async_load=prefetch).",
        [],
    ),
    "breaker_open": (
        "vllm:kvdi_redis_breaker_open",
        "Ranks whose circuit breaker for this Redis node is open.",
        ["node"],
    ),
    "deadline_rtt_seconds": ("vllm:kvdi_deadline_rtt_seconds", "The store's estimated lookup round trip.", []),
    "deadline_load_bytes_per_second": (
        "vllm:kvdi_deadline_load_bytes_per_second",
        "The store's estimated load throughput (prefetches).",
        [],
    ),
    "deadline_prefill_tokens_per_second": (
        "vllm:kvdi_deadline_prefill_tokens_per_second",
        "The engine's estimated prefill rate (kvdi's step timings).",
        [],
    ),
    "store_bytes": (
        "vllm:kvdi_store_bytes",
        "Bytes kvdi's store holds, by kind (host, disk), as its largest rank last measured it.",
        ["store"],
    ),
}
MAX_GAUGES = frozenset({"store_bytes"})
"""Gauges whose ranks may share one store: the observer takes the largest rank's value, not the sum."""
ROLES = ("scheduler", "worker")
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class FleetConnectorStats(KvdiConnectorStats):
    """:class:`KvdiConnectorStats` whose :data:`PROM_KEY` entry is merged by kind and kept out of the log line."""

    def aggregate(self, other: KVConnectorStats) -> FleetConnectorStats:
        mine = {k: v for k, v in self.data.items() if k != PROM_KEY}
        theirs = {k: v for k, v in (other.data or {}).items() if k != PROM_KEY}
        merged = KvdiConnectorStats(data=mine).aggregate(KvdiConnectorStats(data=theirs)).data
        prom = merge_entries(self.data.get(PROM_KEY) or {}, (other.data or {}).get(PROM_KEY) or {})
        return FleetConnectorStats(data={**merged, PROM_KEY: prom} if prom else merged)

    def reduce(self) -> dict[str, int | float]:
        return KvdiConnectorStats(data={k: v for k, v in self.data.items() if k != PROM_KEY}).reduce()

    def is_empty(self) -> bool:
        rest = KvdiConnectorStats(data={k: v for k, v in self.data.items() if k != PROM_KEY})
        return rest.is_empty() and not self.data.get(PROM_KEY)


class KvdiPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc,unused-ignore]
    """kvdi's series, created once; ``observe`` adds one step of stats for one engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        extra = ["connector", "role"]
        # vLLM hands the metric classes over as one dict (its own or multiprocess wrappers): each is its kind.
        counter, histogram = cast("type[Counter]", self._counter_cls), cast("type[Histogram]", self._histogram_cls)
        gauge = cast("type[Gauge]", self._gauge_cls)
        self.counters = {
            k: counter(name=n, documentation=d, labelnames=labelnames + extra) for k, (n, d) in COUNTERS.items()
        }
        self.histograms = {
            k: histogram(name=n, documentation=d, labelnames=labelnames + extra, buckets=SECONDS_BUCKETS)
            for k, (n, d) in HISTOGRAMS.items()
        }
        self.gauges = {
            k: gauge(name=n, documentation=d, labelnames=labelnames + extra + more)
            for k, (n, d, more) in GAUGES.items()
        }
        self._ranks: dict[tuple[int, str, str, str, str], float] = {}  # (engine, role, gauge, label, rank) -> value
        self._connector = _connector_name(vllm_config)
        self.offload = OffloadSeries(counter, gauge, labelnames, self._connector)
        for labelvalues in per_engine_labelvalues.values():  # every series at 0 from the start: rate() works at once
            for role in ROLES:
                base = [*labelvalues, self._connector, role]
                for series in (*self.counters.values(), *self.histograms.values()):
                    series.labels(*base)
                for key, (_name, _doc, more) in GAUGES.items():
                    if not more:
                        self.gauges[key].labels(*base)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        entry = transfer_stats_data.get(PROM_KEY)
        if not entry:
            return
        self.offload.observe(entry, self.per_engine_labelvalues[engine_idx])
        base = [*self.per_engine_labelvalues[engine_idx], self._connector]
        touched: set[tuple[str, str, str]] = set()
        for key, value in entry.items():
            kind, role, rest = key.split("|", 2)
            if kind == "c" and rest in self.counters and value:
                self.counters[rest].labels(*base, role).inc(value)
            elif kind == "h" and rest in self.histograms:
                for seconds in value:
                    self.histograms[rest].labels(*base, role).observe(seconds)
            elif kind == "g":
                rank, gauge, label = rest.split("|", 2)
                if gauge in self.gauges:
                    self._ranks[(engine_idx, role, gauge, label, rank)] = float(value)
                    touched.add((role, gauge, label))
        for role, gauge, label in touched:
            values = [
                v for (e, r, g, lab, _), v in self._ranks.items() if (e, r, g, lab) == (engine_idx, role, gauge, label)
            ]
            total = max(values) if gauge in MAX_GAUGES else sum(values)
            labels = [*base, role, *([label] if GAUGES[gauge][2] else [])]
            self.gauges[gauge].labels(*labels).set(total)


def _connector_name(vllm_config: Any) -> str:
    """The registered kvdi connector name this server's engines use (``kvdi.kv_connector`` or KVDI_KV_CONNECTOR)."""
    try:
        from kvdi.integrations.vllm.config import kvdi_settings_kwargs
        from kvdi.settings import load_settings

        return str(load_settings(**kvdi_settings_kwargs(vllm_config)).kv_connector)
    except Exception as exc:  # a bad setting fails the engine itself, with its one-line reason
        logger.warning("kvdi: metrics labelled connector='unknown': %s", exc)
        return "unknown"


def step_stats(
    name: str, delta: dict[str, int | float] | None, extra: dict[str, int | float] | None, prom: dict[str, Any] | None
) -> FleetConnectorStats | None:
    """One step's stats of one half: kvdi's counters by connector name, and the Prometheus entry; None if empty."""
    data: dict[str, Any] = {name: {**(delta or {}), **(extra or {})}} if delta or extra else {}
    if prom:
        data[PROM_KEY] = prom
    return FleetConnectorStats(data=data) if data else None


def build_prom_metrics(
    vllm_config: Any,
    metric_types: dict[type, type],
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> KvdiPromMetrics:
    """``KvdiConnector.build_prom_metrics``: kvdi's series for ``vllm serve``'s ``/metrics``."""
    return KvdiPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = [
    "COUNTERS",
    "GAUGES",
    "HISTOGRAMS",
    "MAX_GAUGES",
    "ROLES",
    "FleetConnectorStats",
    "KvdiPromMetrics",
    "build_prom_metrics",
    "step_stats",
]
