"""``kvdi demo``: a consumer that loaded a producer's KV generates exactly what a null-connector engine does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvdi.demo import main

SMALL = ["--prompts", "2", "--prompt-len", "48", "--new-tokens", "3"]


@pytest.fixture
def small_model(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Isolated env with a small model and CPU cache, so the demo takes a second."""
    for key, value in {
        "NUM_LAYERS": "2",
        "HIDDEN_SIZE": "64",
        "NUM_HEADS": "4",
        "NUM_KV_HEADS": "2",
        "HEAD_DIM": "16",
        "INTERMEDIATE_SIZE": "128",
        "VOCAB_SIZE": "256",
    }.items():
        monkeypatch.setenv(f"KVDI_MODEL__{key}", value)
    monkeypatch.setenv("KVDI_ALLOCATOR__DEVICE", "cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # subprocesses: no OpenMP spinning on a shared machine
    monkeypatch.setenv("KVDI_ALLOCATOR__BLOCK_SIZE", "8")
    return kvdi_env


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["--json", *SMALL, *args])
    return code, json.loads(capsys.readouterr().out)


def test_demo_exits_0_with_identical_tokens_and_loaded_tokens(
    small_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = run_json(capsys)
    assert code == 0 and report["identical"] is True and report["loaded_tokens"] > 0


def test_demo_json_counts_loaded_and_computed_tokens(small_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, report = run_json(capsys)
    assert report["loaded_tokens"] == 2 * 40  # 5 full blocks of 8 per 48-token prompt; the last block is computed
    assert report["computed_tokens"] == 2 * 8 and report["baseline_computed_tokens"] == 2 * 48
    assert report["bytes_loaded"] > 0 and report["bytes_saved"] >= report["bytes_loaded"]


def test_demo_table_shows_the_same_figures_as_json(small_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, report = run_json(capsys)
    assert main(SMALL) == 0
    table = capsys.readouterr().out
    for figure in ("prompt_tokens", "loaded_tokens", "computed_tokens", "baseline_computed_tokens"):
        assert str(report[figure]) in table
    assert f"{report['bytes_loaded']:,}" in table and "identical" in table and "yes" in table


def test_demo_keeps_what_it_stored_in_the_given_store_dir_only_with_keep(
    small_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """By default the demo discards every block it stored; --keep leaves them in the store."""
    store = tmp_path / "store"
    code, report = run_json(capsys, "--store-dir", str(store))
    assert code == 0 and report["discarded_blocks"] > 0
    assert not any(p.is_file() for p in store.rglob("*"))
    code, report = run_json(capsys, "--store-dir", str(store), "--keep")
    assert code == 0 and report["discarded_blocks"] == 0
    assert any(p.is_file() for p in store.rglob("*"))


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"KVDI_KV_CONNECTOR": "null"}, "'null' stores nothing"),
        ({"KVDI_KV_CONNECTOR": "cpu_offload"}, "'cpu_offload': it keeps blocks in one engine's memory"),
        ({"KVDI_KV_CONNECTOR": "p2p"}, "live producer process to a live consumer process"),
        ({"KVDI_KV_CONNECTOR": "multi", "KVDI_MULTI__TIERS": '["cpu_offload"]'}, "all its tiers (cpu_offload) keep"),
    ],
)
def test_demo_says_which_connectors_it_cannot_run(
    small_model: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], reason: str
) -> None:
    """Before building any engine: exit 2 with one line saying why and what it runs instead."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    done = subprocess.run(
        [sys.executable, "-m", "kvdi.cli", "demo", *SMALL], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert reason in done.stderr and "It runs shared_storage (the default), redis" in done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.redis
def test_demo_on_redis_leaves_no_keys_behind(
    small_model: Path, redis_server: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real redis-server: the demo loads through it, then discards its keys; with --keep they expire in a day."""
    from kvdi.testing.redis_server import command

    monkeypatch.setenv("KVDI_KV_CONNECTOR", "redis")
    monkeypatch.setenv("KVDI_REDIS__URL", redis_server.url)
    code, report = run_json(capsys)
    assert code == 0 and report["loaded_tokens"] > 0 and report["discarded_blocks"] > 0
    assert command(redis_server.port, "DBSIZE") == 0
    code, _ = run_json(capsys, "--keep")
    keys = command(redis_server.port, "KEYS", "kvdi:*")
    assert code == 0 and isinstance(keys, list) and keys
    ttls = [command(redis_server.port, "TTL", key.decode()) for key in keys]
    assert all(isinstance(t, int) and 86_000 < t <= 86_400 for t in ttls)


def test_kvdi_demo_command_exits_0(small_model: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvdi.cli", "demo", "--json", *SMALL], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["identical"] is True and report["loaded_tokens"] > 0
