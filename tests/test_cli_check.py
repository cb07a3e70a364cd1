"""``kvdi check`` says what matters: a plan without noise, warnings an operator acts on, input errors that point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdi import cli_check
from kvdi.cli import main
from kvdi.testing.redis_server import RedisServer, free_port


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_ok_line_has_no_block_count_of_the_reference_engine(
    kvdi_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ok line names the connector and the backend; no "N KV blocks on cpu" (a number that changes with free
    memory and says nothing about vLLM's cache)."""
    monkeypatch.setenv("KVDI_SHARED_STORAGE__PATH", str(tmp_path / "kv"))
    code, out, err = check(capsys)
    assert code == 0, err
    assert out.startswith("ok: connector shared_storage (builtin); backend: shared_storage: ")
    assert "KV blocks" not in out and "staging" not in out


@pytest.mark.redis
@pytest.mark.parametrize(("policy", "warned"), [("noeviction", True), ("allkeys-lru", False)])
def test_a_redis_server_that_evicts_nothing_is_warned_about(
    redis_server_factory: type[RedisServer],
    kvdi_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    policy: str,
    warned: bool,
) -> None:
    """A server under ``maxmemory_policy noeviction`` (redis-server's default, no maxmemory) passes with a warning
    line; one with an eviction policy passes without."""
    server = redis_server_factory(extra_args=("--maxmemory-policy", policy))
    monkeypatch.setenv("KVDI_KV_CONNECTOR", "redis")
    monkeypatch.setenv("KVDI_REDIS__URL", server.url)
    code, out, err = check(capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("ok: connector redis")
    assert any(line.startswith("warning: redis maxmemory_policy is noeviction") for line in lines) is warned


@pytest.mark.parametrize(("cap", "warned"), [(None, True), ("1048576", False)])
def test_an_uncapped_store_on_a_small_disk_is_warned_about(
    kvdi_env: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    cap: str | None,
    warned: bool,
) -> None:
    """shared_storage without ``max_bytes`` on a disk with less free space than the threshold (raised here past any
    disk) gets a warning naming the setting; with a cap, none."""
    monkeypatch.setattr(cli_check, "SMALL_DISK_BYTES", 1 << 62)
    monkeypatch.setenv("KVDI_SHARED_STORAGE__PATH", str(tmp_path / "kv"))
    if cap is not None:
        monkeypatch.setenv("KVDI_SHARED_STORAGE__MAX_BYTES", cap)
    code, out, err = check(capsys)
    assert code == 0, err
    assert ("warning: shared_storage at" in out and "KVDI_SHARED_STORAGE__MAX_BYTES" in out) is warned


def test_a_json_error_says_line_and_column(kvdi_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """JSON that does not parse is one line naming where: line 3, column 31 (the brace), with the text around it."""
    raw = '{"kv_connector": "KvdiConnector",\n "kv_role": "kv_both",\n "kv_connector_extra_config": }'
    code, out, err = check(capsys, "--vllm-config", raw)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--vllm-config is not valid JSON: Expecting value at line 3, column 31" in err


@pytest.mark.parametrize(
    ("config", "where", "meant"),
    [
        ({"kv_connector": "KvdiConector"}, "kv_connector='KvdiConector'", "KvdiConnector"),
        ({"kv_connector": "kvdiconnector"}, "kv_connector='kvdiconnector'", "KvdiConnector"),
        (
            {
                "kv_connector": "MultiConnector",
                "kv_connector_extra_config": {
                    "connectors": [{"kv_connector": "KvdiConnectr"}, {"kv_connector": "OffloadingConnector"}]
                },
            },
            "connectors[0].kv_connector='KvdiConnectr'",
            "KvdiConnector",
        ),
        ({"kv_connector": "MultiConector"}, "kv_connector='MultiConector'", "MultiConnector"),
    ],
)
def test_a_misspelt_connector_class_gets_a_did_you_mean(
    kvdi_env: Path, capsys: pytest.CaptureFixture[str], config: dict[str, object], where: str, meant: str
) -> None:
    """A ``kv_connector`` close to one vLLM registers (or kvdi's), at the top or inside a MultiConnector: one line
    naming where it is and what was probably meant."""
    code, _out, err = check(capsys, "--vllm-config", json.dumps(config))
    assert code == 2 and err.count("\n") == 1
    assert where in err and f"(did you mean {meant!r}?)" in err


@pytest.mark.parametrize(
    "config",
    [
        {"kv_connector": "MyPluginConnector"},
        {"kv_connector": "KvdiConector", "kv_connector_module_path": "my_pkg.connectors"},
    ],
)
def test_other_connectors_are_not_taken_for_typos(
    kvdi_env: Path, capsys: pytest.CaptureFixture[str], config: dict[str, object]
) -> None:
    """A name far from every registered one (a plugin's) or one with its own module path gets no did-you-mean: the
    error is the usual "nothing of kvdi's to read"."""
    code, _out, err = check(capsys, "--vllm-config", json.dumps(config))
    assert code == 2 and "did you mean" not in err and "nothing of kvdi's to read" in err


@pytest.mark.parametrize(
    ("key", "kind", "why"),
    [
        ("kvdi.redis.url", "redis", "redis server cannot serve"),
        ("kvdi.shared_storage.path", "shared_storage", "cannot use it as the KV store directory"),
    ],
)
def test_a_backend_failure_names_the_json_key(
    kvdi_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, kind: str, why: str
) -> None:
    """A backend that cannot be opened (a Redis URL nobody answers, a store folder under a plain file) with
    ``--vllm-config`` is one line naming the ``--kv-transfer-config`` key that set it, no ``KVDI_*`` variable."""
    (tmp_path / "file").write_text("")
    value = f"redis://127.0.0.1:{free_port()}/0" if kind == "redis" else str(tmp_path / "file" / "kv")
    config = {"kv_connector": "KvdiConnector", "kv_connector_extra_config": {"kvdi.kv_connector": kind, key: value}}
    code, out, err = check(capsys, "--vllm-config", json.dumps(config))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert f"--vllm-config key {key}=" in err and why in err and "KVDI_" not in err
