"""The ``kvdi`` command as a user runs it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kvdi(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``kvdi`` in a clean environment (no inherited KVDI_*/VLLM_USE_V1) plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDI_") and k != "VLLM_USE_V1"}
    return subprocess.run(
        [sys.executable, "-m", "kvdi.cli", *args],
        env={**base, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_info_shows_env_as_the_source_of_the_connector(tmp_path: Path) -> None:
    r = kvdi("info", env={"KVDI_KV_CONNECTOR": "null"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "  kv_connector" in r.stdout and '= "null"  [env]' in r.stdout
    assert "scheduler: kvdi.connectors.null.NullSchedulerConnector" in r.stdout
    assert "(not allocated)" in r.stdout


def test_info_shows_file_as_the_source_with_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "p.toml"
    profile.write_text('kv_connector = "null"\n[allocator]\nnum_blocks = 7\ndevice = "cpu"\n')
    r = kvdi("info", "--json", env={"KVDI_SETTINGS_FILE": str(profile)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    rows = {row["setting"]: row for row in info["settings"]}
    assert rows["kv_connector"] == {"setting": "kv_connector", "value": "null", "source": "file"}
    assert rows["allocator.block_size"]["source"] == "default"
    assert info["allocation_plan"]["num_blocks"] == 7 and info["allocation_plan"]["allocated"] is False


def test_info_masks_secrets(tmp_path: Path) -> None:
    r = kvdi(
        "info",
        env={
            "KVDI_KV_CONNECTOR": "null",
            "KVDI_REDIS__URL": "redis://:hunter2@127.0.0.1:1/0",
            "KVDI_KV_CONNECTOR_EXTRA_CONFIG": '{"password": "pw123", "url": "redis://u:pw456@h/0"}',
        },
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    for secret in ("hunter2", "pw123", "pw456"):
        assert secret not in r.stdout


def test_check_passes_on_valid_settings(tmp_path: Path) -> None:
    r = kvdi("check", env={"KVDI_KV_CONNECTOR": "null", "KVDI_ALLOCATOR__NUM_BLOCKS": "4"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: connector null (builtin), 4 KV blocks on")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"KVDI_KV_CONNECTOR": "shared_storag"},
            "registered: cpu_offload, multi, null, p2p, redis, shared_storage (did you mean 'shared_storage'?)",
        ),
        ({"KVDI_USE_V1": "0"}, "V1 gate is off (KVDI_USE_V1=0)"),
        ({"VLLM_USE_V1": "0"}, "V1 gate is off (VLLM_USE_V1=0)"),
        ({"KVDI_KV_ROLE": "producer"}, "KVDI_KV_ROLE='producer'"),
        ({"KVDI_ALLOCATOR__BLOCK_SIZE": "-16"}, "KVDI_ALLOCATOR__BLOCK_SIZE='-16'"),
        ({"KVDI_KV_TRANSFER_CONFIG": '{"kv_role": '}, "KVDI_KV_TRANSFER_CONFIG is not valid JSON"),
        ({"KVDI_KV_CONECTOR": "null"}, "KVDI_KV_CONECTOR is not a kvdi setting (did you mean 'KVDI_KV_CONNECTOR'?)"),
        ({"KVDI_ALLOCATOR__DEVICE": "cuda:7"}, "KVDI_ALLOCATOR__DEVICE='cuda:7'"),
    ],
    ids=["unknown-connector", "kvdi-v1", "vllm-v1", "role", "block-size", "json", "unknown-key", "device"],
)
def test_check_prints_one_line_and_exits_2(tmp_path: Path, env: dict[str, str], expected: str) -> None:
    r = kvdi("check", env=env, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvdi: error: "), r.stderr
    assert expected in lines[0]
    assert "Traceback" not in r.stderr


def test_connectors_lists_every_builtin_without_importing_torch(tmp_path: Path) -> None:
    code = (
        "import sys, json; from kvdi.cli import main; main(['connectors', '--json']); assert 'torch' not in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)}
    assert {"null", "shared_storage", "cpu_offload", "redis", "multi", "p2p"} <= set(rows)
    assert rows["redis"]["requires"] == ["redis"] and rows["null"]["origin"] == "builtin"
    assert rows["shared_storage"]["scheduler"] == "kvdi.connectors.store:StoreSchedulerConnector"


def test_connectors_table_is_printed(tmp_path: Path) -> None:
    r = kvdi("connectors", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "shared_storage" in r.stdout and "builtin" in r.stdout


def test_unknown_benchmark_is_a_usage_error(tmp_path: Path) -> None:
    r = kvdi("bench", "storag", cwd=tmp_path)
    assert r.returncode == 2 and "did you mean 'storage'" in r.stderr
