"""Ratio benchmarks behind ``kvdi bench``: kvdi next to a raw baseline, measured in the same run.

Each module in this package exposes ``run(quick: bool) -> list[BenchResult]``; the CLI runs
the ones asked for and prints a table (or JSON). Timing goals live here, never in tests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class BenchResult:
    """One measured comparison. ``ratio`` is kvdi / baseline (for throughputs, higher is better)."""

    bench: str
    metric: str
    unit: str
    kvdi: float
    baseline: float
    baseline_name: str
    ratio: float
    target: float | None = None
    note: str = ""
    higher_is_better: bool = True

    @property
    def met(self) -> bool | None:
        """Whether the target was met (ratio >= target, or <= when lower is better); None without a target."""
        if self.target is None:
            return None
        return self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}
