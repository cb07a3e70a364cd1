"""kvdi inside a real ``vllm serve`` (OpenAI-compatible server) selected by ``--kv-transfer-config``.

A first server stores the prompts' KV in a shared_storage folder; a second server on the
same folder (kvdi settings from ``KVDI_*`` env this time) answers the same prompts with
identical text and loads blocks. A server with a bad ``kvdi.*`` setting refuses to start
and says why in one line of its log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.serve_support import VllmServer, model_with_tokenizer, word
from tests.real_vllm.vllm_support import expected_blocks, expected_saved, kv_config, read_stats, require_vllm

require_vllm()

pytestmark = pytest.mark.slow


def _texts(server: VllmServer, prompts: list[list[int]]) -> list[str]:
    try:
        server.wait_ready()
        return [server.complete(" ".join(word(t) for t in prompt)) for prompt in prompts]
    except BaseException:
        server.stop()
        raise


def test_second_server_on_the_same_store_loads_and_answers_the_same(
    tmp_path: Path, tiny_model: Path, prompts: list[list[int]]
) -> None:
    model = model_with_tokenizer(tiny_model, tmp_path / "model")
    store = tmp_path / "store"

    first = VllmServer(
        model,
        tmp_path / "serve-1.log",
        kv_config("shared_storage", stats_dir=tmp_path / "stats-1", shared_storage__path=str(store)),
    )
    texts = _texts(first, prompts)
    first.stop()
    assert all(text.split() and all(w.startswith("w") for w in text.split()) for text in texts)
    assert read_stats(tmp_path / "stats-1", "worker")["saved_blocks"] == expected_saved(prompts)

    from_env = kv_config("shared_storage", stats_dir=tmp_path / "stats-2")
    del from_env["kv_connector_extra_config"]["kvdi.kv_connector"]
    second = VllmServer(
        model,
        tmp_path / "serve-2.log",
        from_env,
        env={"KVDI_KV_CONNECTOR": "shared_storage", "KVDI_SHARED_STORAGE__PATH": str(store)},
    )
    again = _texts(second, prompts)
    try:
        assert again == texts
        assert read_stats(tmp_path / "stats-2", "worker")["loaded_blocks"] == expected_blocks(prompts)
        assert read_stats(tmp_path / "stats-2", "scheduler")["lookup_hit_blocks"] == expected_blocks(prompts)
    finally:
        second.stop()


def test_bad_kvdi_setting_stops_the_server_with_a_one_line_reason(tmp_path: Path, tiny_model: Path) -> None:
    model = model_with_tokenizer(tiny_model, tmp_path / "model")
    kv: dict[str, Any] = kv_config(
        "shared_storage", shared_storage__path=str(tmp_path / "store"), shared_storage__max_bytes=-5
    )
    server = VllmServer(model, tmp_path / "serve-bad.log", kv)
    try:
        status = server.wait_exit()
    finally:
        server.stop()

    assert status != 0
    reasons = [line for line in server.log.read_text().splitlines() if "kvdi: " in line]
    assert reasons, server.log_tail()
    assert "shared_storage.max_bytes" in reasons[0] and "-5" in reasons[0]
