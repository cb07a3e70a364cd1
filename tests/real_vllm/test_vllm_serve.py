"""kvdi inside a real ``vllm serve`` (OpenAI-compatible server) selected by ``--kv-transfer-config``.

A first server stores the prompts' KV in a shared_storage folder; a second server on the
same folder (kvdi settings from ``KVDI_*`` env this time) answers the same prompts with
identical text and loads blocks. A server with a bad ``kvdi.*`` setting refuses to start
and says why in one line of its log, naming the ``--kv-transfer-config`` key.

One server runs the README's own command word for word (:func:`readme_command`, on the test
model): it serves a 600-token prompt, answers a prompt whose stored objects were corrupted
(through the ``openai`` client: a miss, counted, recomputed, no HTTP 500, although the
command leaves vLLM's ``kv_load_failure_policy`` at its default ``fail``), and ``vllm bench
serve`` runs against it.
"""

from __future__ import annotations

import random
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.fleet_support import FleetServer, scrape, series
from tests.real_vllm.serve_support import VllmServer, model_with_tokenizer, vllm_cli, word
from tests.real_vllm.vllm_support import (
    BLOCK_SIZE,
    VOCAB,
    expected_blocks,
    expected_saved,
    kv_config,
    read_stats,
    read_stats_settled,
    require_vllm,
)

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
        assert read_stats_settled(tmp_path / "stats-2", "worker")["loaded_blocks"] == expected_blocks(prompts)
        assert read_stats_settled(tmp_path / "stats-2", "scheduler")["lookup_hit_blocks"] == expected_blocks(prompts)
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
    assert "--kv-transfer-config key kvdi.shared_storage.max_bytes=-5" in reasons[0], reasons[0]


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[tuple[FleetServer, Path]]:
    """The README's ``vllm serve`` command (dev endpoints on, to reset vLLM's own prefix cache) and its store."""
    work = tmp_path_factory.mktemp("readme-serve")
    model = model_with_tokenizer(tiny_model, work / "model")
    store = work / "store"
    server = FleetServer(model, work / "serve-readme.log", {}, env={"VLLM_SERVER_DEV_MODE": "1"}, readme_store=store)
    try:
        server.wait_ready()
        yield server, store
    finally:
        server.stop()


def _openai_complete(server: VllmServer, prompt: str) -> str:
    from openai import OpenAI  # type: ignore[import-not-found,unused-ignore]

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.completions.create(model=server.model, prompt=prompt, max_tokens=8, temperature=0)
    return str(reply.choices[0].text)


def _stored_objects(store: Path) -> list[Path]:
    return [p for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")]


def _wait_for(found: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} not seen within {timeout}s")


def test_a_corrupt_stored_object_is_a_counted_miss_under_the_readme_command(
    readme_server: tuple[FleetServer, Path],
) -> None:
    """Every stored object of a prompt corrupted, vLLM's own cache reset: the openai client gets the same greedy
    answer (no HTTP 500), and ``/metrics`` counts the dropped objects."""
    server, store = readme_server
    prompt = " ".join(word(t) for t in random.Random(32).choices(range(3, VOCAB), k=4 * BLOCK_SIZE + 5))
    earlier = set(_stored_objects(store))
    before = _openai_complete(server, prompt)
    objects = _wait_for(
        lambda: [p for p in _stored_objects(store) if p not in earlier][3:] and _stored_objects(store),
        "4 stored objects",
    )
    objects = [p for p in objects if p not in earlier]
    server.post("/reset_prefix_cache")  # vLLM's own cache only: kvdi's store keeps the (corrupted) objects
    for path in objects:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))

    assert _openai_complete(server, prompt) == before
    dropped = _wait_for(
        lambda: (
            series(scrape(server), "vllm:kvdi_corrupt_dropped_total")
            + series(scrape(server), "vllm:kvdi_corrupt_dropped")
        ),
        "vllm:kvdi_corrupt_dropped > 0",
    )
    assert dropped >= 1


def test_a_600_token_prompt_is_served_by_the_readme_command(readme_server: tuple[FleetServer, Path]) -> None:
    """The README's server takes a 600-token prompt (its old ``--max-model-len 512`` answered HTTP 400)."""
    server, _store = readme_server
    prompt = " ".join(word(t) for t in random.Random(600).choices(range(3, VOCAB), k=600))
    text = _openai_complete(server, prompt)
    assert text.split() and all(w.startswith("w") for w in text.split())


def test_vllm_bench_serve_runs_against_the_readme_server(
    readme_server: tuple[FleetServer, Path], tmp_path: Path
) -> None:
    """vLLM's own benchmark client (``vllm bench serve``) runs in the documented venv: 4 requests, all successful."""
    server, _store = readme_server
    command = [
        vllm_cli(), "bench", "serve", "--backend", "openai", "--base-url", server.url, "--model", server.model,
        "--tokenizer", server.model, "--dataset-name", "random", "--random-input-len", "64",
        "--random-output-len", "4", "--num-prompts", "4", "--seed", "0",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert re.search(r"Successful requests:\s+4\b", output), output[-4000:]
