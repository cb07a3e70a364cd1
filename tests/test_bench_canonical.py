"""``kvdi bench canonical`` runs every operation on both formats (no timing asserted: the figures are its output)."""

from __future__ import annotations

from kvdi.bench.canonical import GRIDS, OPS, measure, run


def test_measure_times_save_resave_and_load_on_both_formats() -> None:
    costs = measure(rounds=2, blocks=2, heads=1)
    assert [c.op for c in costs] == list(OPS)
    assert all(c.per_rank > 0 and c.canonical > 0 and len(c.ratios) == 2 for c in costs)


def test_run_quick_reports_every_grid_and_order_each_against_the_bar() -> None:
    rows = run(quick=True)
    assert len(rows) == len(GRIDS) * len(OPS)
    targeted = {r.metric for r in rows if r.target is not None}
    grids = ("a section a block, nhc", "a section a head, hnc", "a section a head, nhc")
    assert targeted == {f"{op} ({grid})" for op in OPS for grid in grids}
