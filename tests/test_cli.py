"""The ``kvdi`` command as a user runs it: real subprocesses, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvdi.registry import BUILTIN_SPECS, ConnectorRegistry

REGISTERED = ", ".join(ConnectorRegistry().names())  # what the CLI's registry lists (entry points included)

ROOT = Path(__file__).resolve().parents[1]


def kvdi(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``kvdi`` in a clean environment (no inherited KVDI_*/VLLM_USE_V1) plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDI_") and k != "VLLM_USE_V1"}
    # The kvdi of this checkout, not whichever one is installed.
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
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
    assert r.stdout.startswith("ok: connector null (builtin); backend: ")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"KVDI_KV_CONNECTOR": "shared_storag"},
            f"registered: {REGISTERED} (did you mean 'shared_storage'?)",
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
    assert {spec.name for spec in BUILTIN_SPECS} <= set(rows)
    assert rows["redis"]["requires"] == ["redis"] and rows["null"]["origin"] == "builtin"
    assert rows["shared_storage"]["scheduler"] == "kvdi.connectors.store:StoreSchedulerConnector"


def test_connectors_table_is_printed(tmp_path: Path) -> None:
    r = kvdi("connectors", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "shared_storage" in r.stdout and "builtin" in r.stdout


def test_connectors_table_tells_the_connectors_apart(tmp_path: Path) -> None:
    """Four connectors share the store halves: the table shows each one's description and backend instead."""
    r = kvdi("connectors", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rows = {line.split("│")[1].strip(): line for line in r.stdout.splitlines() if line.count("│") > 4}
    assert "host memory pool with LRU eviction" in rows["cpu_offload"]
    assert "kvdi.connectors.redis:open_store" in rows["redis"] and "one Redis key per framed block" in rows["redis"]
    assert "StoreSchedulerConnector" not in r.stdout


def test_unknown_benchmark_is_a_usage_error(tmp_path: Path) -> None:
    r = kvdi("bench", "storag", cwd=tmp_path)
    assert r.returncode == 2 and "did you mean 'storage'" in r.stderr


def _deep_toml(tmp_path: Path) -> str:
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    return str(path)


def _nul_toml(tmp_path: Path) -> str:
    path = tmp_path / "nul.toml"
    path.write_text('[shared_storage]\npath = "/tmp/kv\\u0000x"\n')
    return str(path)


def _a_file(tmp_path: Path) -> str:
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return str(path)


@pytest.mark.parametrize(
    ("make_env", "named"),
    [
        (lambda t: {"KVDI_ALLOCATOR__NUM_BLOCKS": "1e15"}, "KVDI_ALLOCATOR__NUM_BLOCKS='1e15'"),
        (lambda t: {"KVDI_ALLOCATOR__NUM_BLOCKS": "2000000000"}, "KVDI_ALLOCATOR__NUM_BLOCKS"),
        (lambda t: {"KVDI_CPU_OFFLOAD__MAX_BYTES": "1e18"}, "KVDI_CPU_OFFLOAD__MAX_BYTES='1e18'"),
        (lambda t: {"KVDI_CPU_OFFLOAD__MAX_BYTES": str(10**18)}, "KVDI_CPU_OFFLOAD__MAX_BYTES"),
        (lambda t: {"KVDI_REDIS__TTL_S": "9223372036854775808"}, "KVDI_REDIS__TTL_S='9223372036854775808'"),
        (lambda t: {"KVDI_REDIS__OP_TIMEOUT_S": "1e300"}, "KVDI_REDIS__OP_TIMEOUT_S='1e300'"),
        (lambda t: {"KVDI_P2P__TIMEOUT_S": "inf"}, "KVDI_P2P__TIMEOUT_S='inf'"),
        (lambda t: {"KVDI_SHARED_STORAGE__PATH": _a_file(t)}, "KVDI_SHARED_STORAGE__PATH="),
        (lambda t: {"KVDI_SHARED_STORAGE__PATH": "/proc/kvdi"}, "KVDI_SHARED_STORAGE__PATH='/proc/kvdi'"),
        (lambda t: {"KVDI_SETTINGS_FILE": _nul_toml(t)}, "KVDI_SETTINGS_FILE="),
        (lambda t: {"KVDI_SETTINGS_FILE": _deep_toml(t)}, "KVDI_SETTINGS_FILE="),
        (
            lambda t: {"KVDI_KV_TRANSFER_CONFIG": '{"kv_connector_extra_config": ' + "[" * 5000 + "]" * 5000 + "}"},
            "KVDI_KV_TRANSFER_CONFIG is nested deeper",
        ),
        (lambda t: {"KVDI_KV_TRANSFER_CONFIG": '{"kv_port": 70000}'}, "KVDI_KV_TRANSFER_CONFIG key kv_port=70000"),
    ],
    ids=[
        "num-blocks-float",
        "num-blocks-over-memory",
        "cpu-offload-float",
        "cpu-offload-over-ram",
        "redis-ttl",
        "redis-op-timeout",
        "p2p-timeout-inf",
        "store-path-file",
        "store-path-proc",
        "store-path-nul",
        "deep-toml",
        "deep-json",
        "transfer-config-port",
    ],
)
def test_check_refuses_absurd_settings_in_one_line(tmp_path: Path, make_env: Any, named: str) -> None:
    """Each absurd setting: exit 2, one line on stderr naming the variable the user set, no traceback."""
    r = kvdi("check", env={"XDG_CACHE_HOME": str(tmp_path / "cache"), **make_env(tmp_path)}, cwd=tmp_path)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("kvdi: error: "), r.stderr
    assert named in lines[0]
    assert "KVDI_P2P__KV_PORT" not in lines[0]


def test_check_opens_and_probes_the_shared_storage_backend(tmp_path: Path) -> None:
    r = kvdi(
        "check",
        env={"KVDI_SHARED_STORAGE__PATH": str(tmp_path / "kv"), "KVDI_ALLOCATOR__NUM_BLOCKS": "4"},
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: connector shared_storage (builtin); backend: ")
    assert (tmp_path / "kv").is_dir()


def test_check_fails_when_the_store_folder_cannot_be_created(tmp_path: Path) -> None:
    """A path below a regular file passes validation (nothing exists yet) but the backend cannot open it."""
    r = kvdi("check", env={"KVDI_SHARED_STORAGE__PATH": str(Path(_a_file(tmp_path)) / "kv")}, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "KVDI_SHARED_STORAGE__PATH=" in r.stderr and "Traceback" not in r.stderr


def test_check_opens_every_tier_of_multi(tmp_path: Path) -> None:
    """multi resolves and opens all its tiers: a broken second tier fails the check."""
    env = {
        "KVDI_KV_CONNECTOR": "multi",
        "KVDI_MULTI__TIERS": '["cpu_offload", "shared_storage"]',
        "KVDI_SHARED_STORAGE__PATH": str(Path(_a_file(tmp_path)) / "kv"),
    }
    r = kvdi("check", env=env, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "KVDI_SHARED_STORAGE__PATH=" in r.stderr


def test_check_fails_on_an_unreachable_redis_with_a_masked_url(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a loopback port with nobody listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"KVDI_KV_CONNECTOR": "redis", "KVDI_REDIS__URL": f"redis://:pa/ss#wd@127.0.0.1:{port}/0"}
    r = kvdi("check", env=env, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "pa/ss" not in r.stderr and "ss#wd" not in r.stderr


def test_info_masks_extra_config_secret_keys_and_odd_passwords(tmp_path: Path) -> None:
    extra = {
        "password": "s3cret-a",
        "token": "s3cret-b",
        "auth": "s3cret-c",
        "api_key": "s3cret-d",
        "access_key": "s3cret-e",
        "secret": "s3cret-f",
        "nested": {"url": "redis://u:s3cret/g#h@host:1/0?password=s3cret-i"},
        "visible": "plain-value",
    }
    env = {
        "KVDI_KV_CONNECTOR": "redis",  # kvdi info shows the selected connector's section only
        "KVDI_REDIS__URL": "redis://:s3cret/j#k@127.0.0.1:1/0",
        "KVDI_KV_CONNECTOR_EXTRA_CONFIG": json.dumps(extra),
    }
    r = kvdi("info", "--json", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "s3cret" not in r.stdout
    rows = {row["setting"]: row["value"] for row in json.loads(r.stdout)["settings"]}
    assert rows["redis.url"] == "redis://:***@127.0.0.1:1/0"
    assert rows["kv_connector_extra_config"]["visible"] == "plain-value"
    assert rows["kv_connector_extra_config"]["nested"]["url"] == "redis://u:***@host:1/0?password=***"


def test_demo_never_prints_a_redis_password_with_slash_or_hash(tmp_path: Path) -> None:
    env = {"KVDI_KV_CONNECTOR": "redis", "KVDI_REDIS__URL": "redis://:pa/ss#wd@127.0.0.1:1/0"}
    r = kvdi("demo", "--prompts", "1", "--prompt-len", "16", "--new-tokens", "1", env=env, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.splitlines()) == 1 and "redis://:***@127.0.0.1:1/0" in r.stderr, r.stderr
    assert "pa/ss" not in r.stdout + r.stderr and "ss#wd" not in r.stdout + r.stderr
