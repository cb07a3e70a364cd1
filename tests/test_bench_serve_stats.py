"""The serving benchmark's statistics (vLLM-free): per-token ITL from coalesced chunks, pooled ratios with their
bootstrap interval and verdict, the server's CPU time from ``/proc``, and the pooled table built from them."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any

import pytest

from benchmarks.vllm.bench_serve_pooled import bar, pooled_table
from benchmarks.vllm.bench_serve_stats import (
    ITL_BUCKETS_S,
    burst_fraction,
    cpu_delta,
    deburst,
    group_cpu_s,
    histogram_delta,
    histogram_quantiles,
    histogram_sum,
    itl_histogram,
    per_request,
    pooled_quantiles,
    ratio_interval,
    repeat_interval,
    server_interval,
    server_spread,
    verdict,
)


def test_a_burst_of_chunks_read_together_shares_the_gap_before_it() -> None:
    # 3 ms, then a burst of 3 chunks (one 6 ms gap, two ~0), then 2 ms
    gaps = [0.003, 0.006, 0.00001, 0.00001, 0.002]
    out = deburst(gaps)
    assert len(out) == len(gaps)
    assert out[0] == pytest.approx(3.0)
    assert out[1:4] == pytest.approx([6.02 / 3] * 3)
    assert out[4] == pytest.approx(2.0)
    assert sum(out) == pytest.approx(sum(gaps) * 1e3)  # a request's decode time is kept


def test_gaps_that_are_all_apart_are_kept_as_they_are() -> None:
    gaps = [0.0025, 0.0031, 0.0022]
    assert deburst(gaps) == pytest.approx([2.5, 3.1, 2.2])
    assert burst_fraction([gaps]) == 0.0
    assert burst_fraction([[0.003, 0.0, 0.0, 0.0]]) == 0.75


def test_per_request_samples_from_the_clients_detailed_result() -> None:
    result: dict[str, Any] = {
        "itls": [[0.002, 0.0, 0.004], [0.003, 0.003, 0.003]],
        "ttfts": [0.010, 0.020],
        "latencies": [0.016, 0.029],
        "output_lens": [4, 4],
    }
    fig = per_request(result)
    assert fig["itl_ms"] == [[1.0, 1.0, 4.0], [3.0, 3.0, 3.0]]
    assert fig["tpot_ms"] == pytest.approx([2.0, 3.0])
    assert fig["burst_fraction"] == pytest.approx(1 / 6, abs=1e-4)


def requests(rng: random.Random, mean: float, count: int = 60, tokens: int = 50) -> list[list[float]]:
    return [[rng.gauss(mean, 0.12 * mean) for _ in range(tokens)] for _ in range(count)]


def test_the_interval_holds_the_true_ratio_and_decides_a_clear_case() -> None:
    rng = random.Random(1)
    base, slower = requests(rng, 2.5), requests(rng, 2.5 * 1.10)
    p50, p90 = ratio_interval(base, slower, boots=200)
    assert p90[1] < 1.10 < p90[2]
    assert p50[1] < 1.10 < p50[2] and p50[1] <= p50[0] <= p50[2]
    assert verdict(p50, 1.03) == "FAIL" and verdict(p50, 1.2) == "pass"
    same = ratio_interval(base, requests(rng, 2.5), boots=200)[0]
    assert verdict(same, 1.03) == "pass"
    assert verdict((1.02, 0.99, 1.05), 1.03) == "undecided"


def test_pooled_quantiles_pool_every_request() -> None:
    p50, p90 = pooled_quantiles([[1.0, 2.0], [3.0, 4.0, 5.0], []])
    assert p50 == 3.0 and p90 == pytest.approx(4.6)


def test_cpu_time_of_a_process_group_is_read_from_proc(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")

    def stat(pid: int, name: str, pgid: int, utime: int, stime: int) -> None:
        (tmp_path / str(pid)).mkdir()
        fields = ["S", "1", str(pgid), "1"] + ["0"] * 7 + [str(utime), str(stime)] + ["0"] * 20
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) " + " ".join(fields) + "\n")

    stat(10, "python", 10, 2 * tick, tick)
    stat(11, "VLLM::EngineCor", 10, 5 * tick, 0)
    stat(12, "other (x)", 99, 7 * tick, 0)  # another group, a name with a space and parentheses
    (tmp_path / "self").mkdir()
    before = group_cpu_s(10, tmp_path)
    assert before == {"python": 3.0, "VLLM::EngineCor": 5.0}
    after = {"python": 3.5, "VLLM::EngineCor": 6.0}
    assert cpu_delta(before, after) == {"python": 0.5, "VLLM::EngineCor": 1.0, "total": 1.5}


def test_this_process_group_has_cpu_time() -> None:
    assert sum(group_cpu_s(os.getpgid(0)).values()) > 0


def test_the_bars_of_issue_31() -> None:
    assert bar("null", "cold") == bar("null@before", "hit") == 1.03
    assert bar("redis", "hit") == 1.05 and bar("cpu_offload", "load") == 1.15
    assert bar("shared_storage", "cold") is None and bar("none", "hit") is None


def test_the_pooled_table_judges_each_configuration_against_its_bar() -> None:
    rng = random.Random(2)

    def result(config: str, repeat: int, mean: float, cpu: float) -> dict[str, Any]:
        fig = {
            "itl_ms": requests(rng, mean, 30),
            "tpot_ms": [mean] * 30,
            "cpu_s": {"python": 9.0, "VLLM::EngineCor": cpu / 2},
        }
        fig["cpu_s"] |= {"VLLM::Worker": cpu / 2, "total": 9.0 + cpu}  # the API server ("python") left out
        fig |= {"total_output_tokens": 1000.0, "burst_fraction": 0.0}
        return {"config": config, "repeat": repeat, "rows": {"prefix_repetition/c4": {"hit": fig}}}

    doc = {"results": [result("noop", r, 2.5, 2.0) for r in range(2)]}
    doc["results"] += [result("null", r, 2.5, 2.1) for r in range(2)]
    doc["results"] += [result("redis", r, 3.0, 3.0) for r in range(2)]
    lines = pooled_table(doc, boots=100)
    (null,) = [line for line in lines if line.strip().startswith("null")]
    (redis,) = [line for line in lines if line.strip().startswith("redis")]
    assert "pass (<= 1.03)" in null and "1.050 [1.050-1.050]" in null  # CPU/token: 2.1 / 2.0 in both repeats
    assert "FAIL (<= 1.05)" in redis
    assert pooled_table({"results": [result("null", 0, 2.5, 1.0)]}) == []  # no noop: no table
    doc["results"][0]["rows"]["prefix_repetition/c4"]["hit"]["burst_fraction"] = 0.5  # noop's tokens read at once
    (null,) = [line for line in pooled_table(doc, boots=20) if line.strip().startswith("null")]
    assert "n/a (bursts)" in null and null.count("(bursts)") == 5  # 4 latency cells and the verdict


METRICS = """# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.001"} 0.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.002"} 10.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.003"} 90.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.004"} 100.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf"} 100.0
vllm:inter_token_latency_seconds_count{engine="0"} 100.0
vllm:inter_token_latency_seconds_sum{engine="0"} 0.25
vllm:inter_token_latency_seconds_created{engine="0"} 1.7e9
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001"} 5.0
"""


def test_vllms_inter_token_histogram_is_read_from_its_metrics_page() -> None:
    hist = itl_histogram(METRICS)
    assert hist == {"0.001": 0.0, "0.002": 10.0, "0.003": 90.0, "0.004": 100.0, "+Inf": 100.0} | {
        "count": 100.0,
        "sum": 0.25,
    }
    p50, p90 = histogram_quantiles(hist)
    assert p50 == pytest.approx(2.5) and p90 == pytest.approx(3.0)  # linear inside the 2-3 ms bucket
    empty = histogram_delta(hist, hist)
    assert empty["count"] == 0 and all(x != x for x in histogram_quantiles(empty))  # nan when nothing came
    assert histogram_sum([hist, hist])["0.003"] == 180.0
    assert len(ITL_BUCKETS_S) == len(set(ITL_BUCKETS_S)) and sorted(ITL_BUCKETS_S) == ITL_BUCKETS_S


def test_the_repeat_interval_is_a_t_interval_of_the_log_ratios() -> None:
    assert repeat_interval([1.02]) is None
    mean, low, high = repeat_interval([1.0, 1.0, 1.0]) or (0, 0, 0)
    assert mean == low == high == pytest.approx(1.0)
    mean, low, high = repeat_interval([0.98, 1.02, 1.01, 0.99]) or (0, 0, 0)
    assert low < 0.99 < mean < 1.01 < high < 1.03


def test_the_server_side_table_pairs_each_repeat_with_its_noop() -> None:
    def hist(ms: float) -> dict[str, float]:  # every token at ms, in a bucket of 0.1 ms around it
        return {str((ms - 0.05) / 1e3): 0.0, str((ms + 0.05) / 1e3): 100.0, "+Inf": 100.0, "count": 100.0,
                "sum": ms / 10}  # fmt: skip

    def result(config: str, repeat: int, ms: float) -> dict[str, Any]:
        fig = {"itl_ms": [[ms] * 5] * 4, "tpot_ms": [ms] * 4, "server_itl_hist": hist(ms)}
        return {"config": config, "repeat": repeat, "rows": {"random/c4": {"hit": fig}}}

    doc = {"results": [result("noop", r, 2.0 + r / 10) for r in range(4)]}
    doc["results"] += [result("null", r, (2.0 + r / 10) * 1.01) for r in range(4)]
    doc["results"] += [result("cpu_offload", r, (2.0 + r / 10) * (1.2 if r % 2 else 0.9)) for r in range(4)]
    lines = pooled_table(doc, boots=50)
    start = lines.index(next(line for line in lines if line.strip().startswith("(server side)")))
    null, offload = lines[start + 2], lines[start + 3]
    assert null.split()[0] == "null" and "pass (<= 1.03)" in null and "1.010 [1.010-1.010]" in null
    assert offload.split()[0] == "cpu_offload" and "undecided (<= 1.05)" in offload


def test_the_multi_turn_table_judges_cpu_offload_and_shared_storage_against_noop() -> None:
    from benchmarks.vllm.bench_serve_report import multi_turn_table

    def result(config: str, repeat: int, scale: float) -> dict[str, Any]:
        base = 40.0 + repeat
        fig = {"ttft_p50_ms": base * scale, "ttft_p90_ms": 2 * base * scale, "run_s": base / 10 * scale}
        return {"config": config, "repeat": repeat, "multi_turn": fig}

    results = [result("noop", r, 1.0) for r in range(3)]
    results += [result("cpu_offload", r, 0.8) for r in range(3)]
    results += [result("shared_storage", r, 1.3) for r in range(3)]
    results += [result("null", r, 1.3) for r in range(3)]
    lines = {line.split()[0]: line for line in multi_turn_table(results)[2:]}
    assert lines["cpu_offload"].endswith("pass (<= 1.0)")
    assert lines["shared_storage"].endswith("FAIL (<= 1.0)")
    assert lines["null"].endswith("-")


def test_the_interval_over_servers_takes_each_servers_mean_as_one_sample() -> None:
    e = math.exp
    per_server = [[e(0.0), e(0.2)], [e(0.1), e(0.3)], [e(0.4)]]  # log means 0.1, 0.2, 0.4
    centre, low, high = server_interval(per_server) or (0.0, 0.0, 0.0)
    assert centre == pytest.approx(e((0.1 + 0.2 + 0.4) / 3))
    sd = math.sqrt(((0.1 - 0.7 / 3) ** 2 + (0.2 - 0.7 / 3) ** 2 + (0.4 - 0.7 / 3) ** 2) / 2)
    assert high == pytest.approx(e(0.7 / 3 + 2.920 * sd / math.sqrt(3)))  # t with 2 degrees of freedom
    assert low < centre < high
    assert server_interval([[1.0, 1.2, 0.9]]) is None  # one server, however many rounds, decides nothing


def test_the_spread_within_a_server_and_between_servers_are_told_apart() -> None:
    e = math.exp
    # within: deviations of +-0.1 in each server (pooled variance 0.02); means 0.1 and 0.5 (variance 0.08)
    within, between = server_spread([[e(0.0), e(0.2)], [e(0.4), e(0.6)]]) or (0.0, 0.0)
    assert within == pytest.approx(math.sqrt(0.02))
    assert between == pytest.approx(math.sqrt(0.08 - 0.02 / 2))
    # means as close as the rounds' noise alone would put them: no server effect is left
    assert server_spread([[e(0.0), e(0.2)], [e(0.1), e(0.3)]]) == (pytest.approx(math.sqrt(0.02)), 0.0)
    assert server_spread([[1.0], [1.1]]) is None  # no server of two rounds: within cannot be told
