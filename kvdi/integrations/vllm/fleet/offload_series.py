"""kvdi's tiers under the series names of vLLM's own offloading connector, for dashboards built for it (vLLM-free).

vLLM 0.33's ``OffloadingConnector`` publishes ``vllm:kv_offload_config_info`` (a gauge at 1
whose labels describe each tier, ``tier`` as ``<index>:<type>``), the flat transfer counters
``vllm:kv_offload_{load,store}_{bytes,time}`` (GPU to and from the offload medium) and, for its
tiering spec, ``vllm:kv_offload_tiering_{read,write}_{bytes,time}`` by ``tier``. kvdi publishes
the same names from its own counters (worker role only, where transfers happen):

- ``vllm:kv_offload_config_info{tier, connector, store}``: one series per kvdi store tier
  (``0:host``, ``0:disk``, ``1:remote``...: index in the store tree, then the tier's kind; a
  remote store, whose hits vLLM counts as ``external_unspecified``, reads ``remote``);
- ``vllm:kv_offload_load_bytes`` / ``_store_bytes``: kvdi's ``loaded_bytes`` / ``saved_bytes``
  (payload, one rank's slice each, summed over ranks), ``_load_time`` / ``_store_time``: the
  seconds of ``load_seconds`` / ``save_seconds`` (with ``transfer.async_save`` the time to queue
  a step's saves, not to write them);
- ``vllm:kv_offload_tiering_{read,write}_{bytes,time}{tier}``: the same, by tier, for a store
  of one tier (each tier's share of a ``multi`` store's transfers is not counted: no series).

The series are created on the first :meth:`OffloadSeries.observe`, after every connector of
the server built its own at start-up: a name vLLM's own connector already registered (kvdi
beside ``OffloadingConnector`` in a ``MultiConnector``) is left to it, logged once, never a
second registration (prometheus_client refuses one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

logger = logging.getLogger(f"vllm.{__name__}")

CONFIG_INFO = "vllm:kv_offload_config_info"
FLAT: dict[tuple[str, str], tuple[str, str]] = {  # (entry kind, kvdi counter) -> (vLLM name, help)
    ("c", "loaded_bytes"): ("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU (kvdi)."),
    ("c", "saved_bytes"): ("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage (kvdi)."),
    ("h", "load_seconds"): ("vllm:kv_offload_load_time", "Total load time from offload storage to GPU, in seconds."),
    ("h", "save_seconds"): ("vllm:kv_offload_store_time", "Total store time from GPU to offload storage, in seconds."),
}
TIERED: dict[str, tuple[str, str]] = {  # kvdi's per-tier counter -> (vLLM name, help)
    "tier_read_bytes": ("vllm:kv_offload_tiering_read_bytes", "Total bytes read from a kvdi tier, by tier."),
    "tier_read_seconds": ("vllm:kv_offload_tiering_read_time", "Seconds spent reading from a kvdi tier, by tier."),
    "tier_write_bytes": ("vllm:kv_offload_tiering_write_bytes", "Total bytes written to a kvdi tier, by tier."),
    "tier_write_seconds": ("vllm:kv_offload_tiering_write_time", "Seconds spent writing to a kvdi tier, by tier."),
}
TIER_COUNTERS = {"loaded_bytes": "tier_read_bytes", "load_seconds": "tier_read_seconds"} | {
    "saved_bytes": "tier_write_bytes",
    "save_seconds": "tier_write_seconds",
}
"""kvdi's counter -> its per-tier counter, for a store of one tier."""
INFO_HELP = (
    "Static configuration of the KV offload tiers of this engine, set to 1: one series per kvdi store tier "
    "(tier is <index>:<kind>)."
)
TIER_KINDS = {"external_unspecified": "remote"}
"""A store's hit source -> the kind in its tier label (vLLM's own names otherwise: host, disk, p2p)."""


def tier_labels(hit_sources: Iterable[str]) -> list[str]:
    """``<index>:<kind>`` of each tier, in the store tree's order."""
    return [f"{i}:{TIER_KINDS.get(source, source)}" for i, source in enumerate(hit_sources)]


class OffloadSeries:
    """The vLLM offloading series kvdi publishes (see the module docstring); made on the first observe."""

    def __init__(
        self, counter: Callable[..., Any], gauge: Callable[..., Any], labelnames: Sequence[str], connector: str
    ) -> None:
        self._counter, self._gauge = counter, gauge
        self._labelnames = list(labelnames)
        self._connector = connector
        self._series: dict[str, Any] | None = None  # vLLM name -> metric, None where vLLM's own connector has it

    def _make(self) -> dict[str, Any]:
        wanted: list[tuple[str, str, Callable[..., Any], list[str]]] = [
            (CONFIG_INFO, INFO_HELP, self._gauge, ["tier", "connector", "store"]),
            *((name, doc, self._counter, []) for name, doc in FLAT.values()),
            *((name, doc, self._counter, ["tier"]) for name, doc in TIERED.values()),
        ]
        made: dict[str, Any] = {}
        taken: list[str] = []
        for name, doc, kind, more in wanted:
            try:
                made[name] = kind(name=name, documentation=doc, labelnames=[*self._labelnames, *more])
            except ValueError:  # registered already: vLLM's own offloading connector publishes it
                made[name] = None
                taken.append(name)
        if taken:
            logger.warning("kvdi: %s already published by another connector; kvdi leaves them to it", taken)
        return made

    def observe(self, entry: dict[str, Any], labelvalues: Sequence[object]) -> None:
        """Add one step's Prometheus entry of kvdi's (worker role) to the series, for one engine's labels."""
        if self._series is None:
            self._series = self._make()
        base = [*labelvalues]
        for key, value in entry.items():
            kind, role, rest = key.split("|", 2)
            if role != "worker":
                continue
            if (kind, rest) in FLAT:
                amount = sum(value) if kind == "h" else value
                self._inc(FLAT[(kind, rest)][0], base, amount)
            elif kind == "c" and "|" in rest:
                counter, tier = rest.split("|", 1)
                if counter in TIERED:
                    self._inc(TIERED[counter][0], [*base, tier], value)
            elif kind == "g":
                _rank, gauge, label = rest.split("|", 2)
                info = self._series.get(CONFIG_INFO)
                if gauge == "tier_info" and info is not None:
                    tier, store = label.split("|", 1)
                    info.labels(*base, tier, self._connector, store).set(1)

    def _inc(self, name: str, labels: list[object], amount: float) -> None:
        series = self._series.get(name) if self._series is not None else None
        if series is not None and amount:
            series.labels(*labels).inc(amount)


__all__ = ["CONFIG_INFO", "FLAT", "TIERED", "TIER_COUNTERS", "OffloadSeries", "tier_labels"]
