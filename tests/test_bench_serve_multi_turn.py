"""The multi-turn serving benchmark's conversations and figures (vLLM-free): every measured turn is counted, the
unmeasured last turn (sent so that vLLM's client does not stop before the other conversations' last turns) is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.vllm.bench_serve_multi_turn import ANSWER_TOKENS, CONVERSATIONS, TURNS, conversations, figures


def test_each_conversation_has_its_measured_turns_and_a_short_last_one_under_the_model_length(tmp_path: Path) -> None:
    items = json.loads(conversations(tmp_path / "c.json", seed=0).read_text())
    assert len(items) == CONVERSATIONS
    for item in items:
        users = [m["content"].split() for m in item["messages"] if m["role"] == "user"]
        assert len(users) == TURNS + 1 and len(users[-1]) < min(len(u) for u in users[:-1])
        assert sum(map(len, users)) + (TURNS + 1) * ANSWER_TOKENS < 512


def test_the_figures_count_the_measured_turns_only(tmp_path: Path) -> None:
    rows = [
        {"ttft_ms": 10.0 * turn, "latency_ms": 5.0, "start_time_ms": 100.0 * turn, "input_num_turns": 2 * turn - 1}
        for turn in range(1, TURNS + 2)
    ]
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(rows))
    fig = figures(stats, 0.0)
    assert fig["requests"] == TURNS
    assert fig["run_s"] == (100.0 * TURNS + 5.0 - 100.0) / 1e3  # the last turn's request is not in the run


def test_engine_means_are_the_mean_ms_of_the_requests_between_two_reads() -> None:
    from benchmarks.vllm.bench_serve_multi_turn import engine_means

    names = ("vllm:request_prefill_time_seconds", "vllm:request_inference_time_seconds")
    before = {f"{names[0]}_sum": 1.0, f"{names[0]}_count": 10.0, f"{names[1]}_sum": 2.0, f"{names[1]}_count": 10.0}
    after = {f"{names[0]}_sum": 1.5, f"{names[0]}_count": 20.0, f"{names[1]}_sum": 2.0, f"{names[1]}_count": 10.0}
    assert engine_means(before, after) == {"engine_prefill_ms": 50.0}  # no request finished: no inference mean


def test_the_engines_columns_are_shown_but_the_bar_is_on_the_clients_figures() -> None:
    from benchmarks.vllm.bench_serve_report import multi_turn_table

    base = {"ttft_p50_ms": 10.0, "ttft_p90_ms": 20.0, "run_s": 4.0, "engine_prefill_ms": 5.0, "engine_request_ms": 9.0}
    fast = {k: v * (0.8 if k in ("ttft_p50_ms", "ttft_p90_ms", "run_s") else 1.5) for k, v in base.items()}
    results = [
        {"config": c, "repeat": r, "multi_turn": {k: v * (1 + 0.01 * r) for k, v in fig.items()}}
        for r in range(3)
        for c, fig in (("noop", base), ("cpu_offload", fast))
    ]
    lines = multi_turn_table(results)
    assert "engine prefill" in lines[1] and "engine request" in lines[1]
    row = next(line for line in lines if line.strip().startswith("cpu_offload"))
    assert "1.50 [1.50-1.50]" in row and row.endswith("pass (<= 1.0)")


def test_a_runs_server_work_is_vllms_and_kvdis_counters_moved_and_the_engine_means() -> None:
    from benchmarks.vllm.bench_serve_multi_turn import server_counters, server_work

    page = "\n".join([
        "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
        'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0',
        'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9',
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 96.0',
        'vllm:kvdi_loaded_blocks_total{role="worker",rank="0"} 4.0',
        'vllm:kvdi_loaded_blocks_total{role="worker",rank="1"} 2.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 999.0',
    ])  # fmt: skip
    before = server_counters(page)
    assert before == {"vllm:num_preemptions": 3.0, "vllm:prefix_cache_hits": 640.0,
                      "vllm:external_prefix_cache_hits": 96.0, "kvdi loaded_blocks": 6.0}  # fmt: skip
    times = {"vllm:request_prefill_time_seconds_sum": 1.0, "vllm:request_prefill_time_seconds_count": 10.0,
             "vllm:request_inference_time_seconds_sum": 2.0, "vllm:request_inference_time_seconds_count": 10.0}  # fmt: skip
    later = {**times, "vllm:request_prefill_time_seconds_sum": 1.5, "vllm:request_prefill_time_seconds_count": 20.0}
    after = {**before, "vllm:num_preemptions": 5.0, "kvdi loaded_blocks": 16.0, "kvdi saved_blocks": 4.0}
    work = server_work(before | times, after | later)
    assert work == {"engine_prefill_ms": pytest.approx(50.0), "vllm:num_preemptions": 2.0,
                    "kvdi loaded_blocks": 10.0, "kvdi saved_blocks": 4.0}  # fmt: skip


def test_a_runs_server_ttft_quantiles_are_those_of_the_requests_between_the_two_reads() -> None:
    from benchmarks.vllm.bench_serve_multi_turn import TTFT, server_work

    def hist(counts: dict[str, float]) -> dict[str, float]:
        return {f"{TTFT}|{le}": n for le, n in counts.items()}

    before = hist({"0.01": 5.0, "0.02": 5.0, "+Inf": 5.0, "count": 5.0, "sum": 0.04})
    # 10 more requests: 5 at most 10 ms, 5 between 10 and 20 ms
    after = hist({"0.01": 10.0, "0.02": 15.0, "+Inf": 15.0, "count": 15.0, "sum": 0.2})
    work = server_work(before, after)
    assert work == {"server_ttft_p50_ms": pytest.approx(10.0), "server_ttft_p90_ms": pytest.approx(18.0)}
    assert server_work(before, before) == {}  # no request: no quantile
