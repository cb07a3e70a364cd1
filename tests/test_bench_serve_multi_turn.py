"""The multi-turn serving benchmark's conversations and figures (vLLM-free): every measured turn is counted, the
unmeasured last turn (sent so that vLLM's client does not stop before the other conversations' last turns) is not."""

from __future__ import annotations

import json
from pathlib import Path

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
