"""Sliced rounds of the in-server A/B (vLLM-free): the order of a round's passes and how a mode's slices merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.vllm.bench_serve_slices import (
    FIGURES,
    Measured,
    figures,
    log_sd,
    main,
    merge,
    pair_ratios,
    plan,
    position_ratios,
    slice_seed,
)

MODES = ("noop", "kvdi")


def test_a_slice_runs_both_modes_of_each_phase_side_by_side_and_alternates_who_goes_first() -> None:
    assert plan(0, 2, MODES) == [
        (0, "noop", "cold"), (0, "kvdi", "cold"), (0, "kvdi", "hit"), (0, "noop", "hit"),
        (0, "noop", "load"), (0, "kvdi", "load"),
        (1, "kvdi", "cold"), (1, "noop", "cold"), (1, "noop", "hit"), (1, "kvdi", "hit"),
        (1, "kvdi", "load"), (1, "noop", "load"),
    ]  # fmt: skip
    for r in range(2):
        steps = plan(r, 4, MODES)
        assert len(steps) == 24 and {(i, m, p) for i, m, p in steps} == {
            (i, m, p) for i in range(4) for m in MODES for p in ("cold", "hit", "load")
        }
        for k in range(0, 24, 2):  # each phase's two passes are neighbours, of one slice, one in each mode
            (i, a, phase), (j, b, other) = steps[k], steps[k + 1]
            assert (i, phase) == (j, other) and {a, b} == set(MODES)
        for phase in ("cold", "hit", "load"):  # each mode runs first in half of the slices
            firsts = [steps[k][1] for k in range(0, 24, 2) if steps[k][2] == phase]
            assert sorted(firsts) == ["kvdi", "kvdi", "noop", "noop"]
        flips = sum(steps[k][1] != steps[k + 1][1] for k in range(23))
        assert flips == 4 * 3  # three inside a slice; the next slice starts in the mode the last one ended in
    assert plan(1, 1, MODES)[0] == (0, "kvdi", "cold")  # the next round starts with the other mode
    seeds = {slice_seed(r, i) for r in range(999) for i in range(16)}
    assert len(seeds) == 999 * 16 and not seeds & ({1000 + r for r in range(999)} | {10_000})


def _hist(counts: dict[str, float], total_s: float) -> dict[str, float]:
    """A cumulative histogram of the given per-bucket counts (bounds in seconds, as vLLM's ``le``)."""
    out, running = {}, 0.0
    for bound, n in counts.items():
        running += n
        out[bound] = running
    return out | {"+Inf": running, "count": running, "sum": total_s}


def test_slices_merge_into_one_pass_of_summed_histograms_pooled_ttfts_and_summed_work() -> None:
    fast = Measured(
        {
            "completed": 8.0,
            "client ITL p50": 4.0,
            "kvdi lookups": 8.0,
            "cpu worker main": 100.0,
            "stalls": 1.0,
            "steal %": 0.5,
        },
        _hist({"0.004": 90.0, "0.008": 10.0}, 0.4),
        [10.0, 20.0],
    )
    slow = Measured(
        {"completed": 8.0, "client ITL p50": 8.0, "cpu worker main": 300.0, "stalls": 0.0, "steal %": 3.0},
        _hist({"0.004": 0.0, "0.008": 100.0}, 0.8),
        [30.0, 40.0],
    )
    out = merge([fast, slow])
    assert out["server ITL p50"] == pytest.approx(4.0 + 4.0 * 10 / 110)  # rank 100 of 200: 10 into the 110 of 4-8 ms
    assert figures(fast.hist, [])["server ITL p50"] == pytest.approx(4.0 * 50 / 90)  # the fast slice alone
    assert out["server ITL mean"] == pytest.approx(6.0)  # 1.2 s over 200 gaps, not the mean of 4 and 8 ms
    assert out["TTFT p50"] == pytest.approx(25.0) and out["TTFT p90"] == pytest.approx(37.0)
    assert out["completed"] == 16.0 and out["kvdi lookups"] == 8.0 and out["cpu worker main"] == 400.0
    assert out["stalls"] == 1.0 and out["client ITL p50"] == 6.0 and out["slices"] == 2.0
    assert out["steal %"] == 3.0  # the worst slice's
    assert set(out) == {*FIGURES, "completed", "client ITL p50", "kvdi lookups", "cpu worker main", "stalls", "slices",
                        "steal %"}  # fmt: skip


def test_slices_that_do_not_divide_the_prompts_into_fours_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from benchmarks.vllm import bench_serve_switch

    for slices in ("3", "16", "0"):
        assert bench_serve_switch.main(["--rounds", "2", "--slices", slices]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"--slices {slices}: allowed 1-16, dividing --prompts (32) into slices of at least 4 prompts"]
    assert bench_serve_switch.main(["--rounds", "2", "--slices", "8", "--prompts", "31"]) == 2
    assert capsys.readouterr().err.startswith("--slices 8: allowed 1-16, dividing --prompts (31)")


def _line(r: int, i: int, mode: str, phase: str, p50: float) -> str:
    return (f"  null r{r}.{i} {mode:4s} {phase:4s} server ITL p50 {p50:.3f} server ITL p90 {p50 * 2:.3f} "
            f"server ITL mean {p50:.3f} TTFT p50 40.000 TTFT p90 50.000 completed 8.000")  # fmt: skip


def test_the_spread_of_a_slice_pair_and_of_a_round_come_from_a_results_files_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hit = {(0, 0): (4.0, 4.4), (0, 1): (5.0, 5.0), (1, 0): (4.0, 3.6), (1, 1): (5.0, 5.0)}  # noop, kvdi ITL p50
    lines = [_line(r, i, mode, "hit", v) for (r, i), pair in hit.items() for mode, v in zip(MODES, pair, strict=True)]
    lines.append(_line(1, 1, "kvdi", "load", 5.0))  # a pass without its neighbour: no pair
    rounds = [{m: {"hit": dict.fromkeys(FIGURES, v)} for m, v in zip(MODES, pair, strict=True)}
              for pair in ((9.0, 9.0 * 1.05), (9.0, 9.0 / 1.05))]  # fmt: skip
    doc = {
        "benchmark": "bench_serve_switch",
        "args": {"slices": "2"},
        "results": [{"config": "null", "server": k, "rounds": [r]} for k, r in enumerate(rounds)],  # --servers 2
    }
    path = tmp_path / "run.txt"
    path.write_text("\n".join(["# run: main at 1234abc", json.dumps(doc), *lines]))
    ratios = pair_ratios(path.read_text().splitlines())
    assert list(ratios) == [("null", "hit")] and ratios["null", "hit"]["p50"] == pytest.approx([1.1, 1.0, 0.9, 1.0])
    assert main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    pair, whole = log_sd([1.1, 1.0, 0.9, 1.0]), log_sd([1.05, 1 / 1.05])
    assert out[1] == (f"  null hit: 4 pairs, 2 rounds of 2; spread of a pair / of a round (a round of independent "
                      f"pairs): p50 {pair:.1%} / {whole:.1%} ({pair / 2**0.5:.1%}), p90 {pair:.1%} / {whole:.1%} "
                      f"({pair / 2**0.5:.1%}), mean {pair:.1%} / {whole:.1%} ({pair / 2**0.5:.1%})")  # fmt: skip
    assert (
        out[2]
        == "  null hit: ITL p50 kvdi / noop by the pass that ran first (geometric mean): noop first 0.997 (4 pairs)"
    )
    path.write_text("\n".join(lines))  # the passes without the run's document
    assert main([str(path)]) == 2
    assert capsys.readouterr().err == f"{path}: cannot be read as a sliced results file (it holds no " \
                                      "bench_serve_switch run document)\n"  # fmt: skip
    path.write_text(json.dumps(doc))  # the document without the passes
    assert main([str(path)]) == 2 and "holds no sliced passes" in capsys.readouterr().err


def test_a_slices_ratio_is_split_by_the_mode_whose_pass_ran_first() -> None:
    lines = [_line(0, 0, "kvdi", "load", 4.4), _line(0, 0, "noop", "load", 4.0),  # kvdi first: 1.1
             _line(0, 1, "noop", "load", 5.0), _line(0, 1, "kvdi", "load", 5.0),  # noop first: 1.0
             _line(1, 0, "kvdi", "load", 3.6), _line(1, 0, "noop", "load", 4.0),  # kvdi first: 0.9
             _line(1, 1, "kvdi", "hit", 5.0)]  # fmt: skip
    split = position_ratios(lines)
    assert list(split) == [("null", "load")]
    assert split["null", "load"]["kvdi first"] == pytest.approx([1.1, 0.9])
    assert split["null", "load"]["noop first"] == pytest.approx([1.0])
