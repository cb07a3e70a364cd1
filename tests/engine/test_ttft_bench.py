"""The TTFT benchmark's plumbing (its figures are for `kvdi bench ttft`, not for tests)."""

from __future__ import annotations

from pathlib import Path

from kvdi.bench.ttft import measure


def test_ttft_bench_loads_all_but_the_last_block_and_keeps_the_first_token(kvdi_env: Path, tmp_path: Path) -> None:
    result = measure(prompt_len=64, reps=1, store_dir=tmp_path)
    assert result.bench == "ttft" and result.kvdi > 0 and result.baseline > 0
    assert "48 tokens loaded via 'shared_storage'" in result.note and "DIFFER" not in result.note
