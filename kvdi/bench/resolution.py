"""Cost of getting a connector half from the container vs constructing it directly."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvdi.bench import BenchResult
from kvdi.connectors.base import ConnectorContext, KVConnectorRole
from kvdi.containers import build_kv_container

TARGET_ADDED_US = 20.0


def _per_call_us(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` mean time per call in microseconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def run(quick: bool) -> list[BenchResult]:
    """Time ``container.worker_connector()`` next to ``Cls(ConnectorContext(...))`` in the same run."""
    container = build_kv_container(kv_connector="null")
    resolved = container.connector()
    settings, layout, options, backend = (
        container.settings(),
        container.layout(),
        container.options(),
        container.backend(),
    )
    cls = resolved.worker_cls

    def direct() -> object:
        return cls(ConnectorContext(resolved.spec.name, KVConnectorRole.WORKER, settings, layout, options, backend))

    calls = 2_000 if quick else 20_000
    via_container = _per_call_us(container.worker_connector, calls)
    by_hand = _per_call_us(direct, calls)
    added = via_container - by_hand
    return [
        BenchResult(
            "resolution",
            "worker_connector() per call",
            "us",
            via_container,
            by_hand,
            "direct construction",
            via_container / by_hand,
            note=f"added {added:.2f} us per call",
        ),
        BenchResult(
            "resolution",
            "added time per call",
            "us",
            added,
            TARGET_ADDED_US,
            "target bound",
            added / TARGET_ADDED_US,
            target=1.0,
            higher_is_better=False,
            note=f"{added:.2f} us added; target < {TARGET_ADDED_US:g} us",
        ),
    ]
