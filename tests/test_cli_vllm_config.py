"""``kvdi check --vllm-config JSON`` and ``KVDI_KV_TRANSFER_CONFIG``: a server's kvdi settings checked before it starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvdi.cli import main
from kvdi.errors import ConfigError
from kvdi.settings import load_settings
from kvdi.settings.vllm_compat import adapter_overrides


def serve_config(store: Path, **kvdi: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of docs/vllm.md: KvdiConnector by name, kvdi.* keys in extra config."""
    extra = {"kvdi.kv_connector": "shared_storage", "kvdi.shared_storage.path": str(store)}
    extra.update({f"kvdi.{key}": value for key, value in kvdi.items()})
    return {"kv_connector": "KvdiConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_vllm_config_opens_the_backend_the_adapter_would(
    kvdi_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The serve JSON (with the module path, as older docs wrote it) passes and the store folder is probed."""
    config = {**serve_config(tmp_path / "store"), "kv_connector_module_path": "kvdi.integrations.vllm"}
    code, out, err = check(capsys, "--vllm-config", json.dumps(config))
    assert code == 0, err
    assert out.startswith("ok: connector shared_storage")
    assert out.startswith("ok: connector shared_storage") and str(tmp_path / "store") in out


def test_a_bad_kvdi_key_in_the_vllm_config_fails_naming_the_json_key(
    kvdi_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bounded kvdi.* value is validated (exit 2, one line naming the key, the value and the bound)."""
    config = serve_config(tmp_path / "store", **{"shared_storage.max_bytes": -5, "redis.ttl_s": -1})
    code, out, err = check(capsys, "--vllm-config", json.dumps(config))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "shared_storage.max_bytes (--vllm-config key kvdi.shared_storage.max_bytes=-5)" in err
    assert "redis.ttl_s (--vllm-config key kvdi.redis.ttl_s=-1)" in err


def test_a_misspelt_kvdi_key_in_the_vllm_config_is_refused(
    kvdi_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = serve_config(tmp_path / "store", **{"shared_storag.path": "/tmp"})
    code, _out, err = check(capsys, "--vllm-config", json.dumps(config))
    assert code == 2
    assert "shared_storag (--vllm-config key kvdi.shared_storag): unknown setting" in err
    assert "did you mean 'shared_storage'" in err


def test_multiconnector_with_a_kvdi_child_is_checked(
    kvdi_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The KvdiConnector child of vLLM's MultiConnector is what kvdi reads; it inherits the parent's role."""
    child = serve_config(tmp_path / "store")
    del child["kv_role"]
    config = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"connectors": [child]},
    }
    assert load_settings(**adapter_overrides(config, "x")).kv_role == "kv_consumer"
    code, out, err = check(capsys, "--vllm-config", json.dumps(config))
    assert code == 0, err
    assert out.startswith("ok: connector shared_storage")


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("{", "--vllm-config is not valid JSON"),
        ("[1]", "--vllm-config must be a JSON object"),
        ('{"kv_connector": "LMCacheConnectorV1"}', "nothing of kvdi's to read"),
        (
            '{"kv_connector": "KvdiConnector", "kv_connector_module_path": "evil.mod"}',
            "kv_connector_module_path='evil.mod'",
        ),
        ('{"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": []}}', "0 KvdiConnector"),
    ],
)
def test_vllm_configs_kvdi_cannot_read_fail_in_one_line(
    kvdi_env: Path, capsys: pytest.CaptureFixture[str], config: str, needle: str
) -> None:
    code, _out, err = check(capsys, "--vllm-config", config)
    assert code == 2 and needle in err and err.count("\n") == 1


def test_the_serve_json_in_kvdi_kv_transfer_config_is_read_as_the_adapter_reads_it(
    kvdi_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """KVDI_KV_TRANSFER_CONFIG may hold the serve JSON: `kvdi check` then checks it (no traceback, no import of vLLM)."""
    monkeypatch.setenv("KVDI_KV_TRANSFER_CONFIG", json.dumps(serve_config(tmp_path / "store")))
    settings = load_settings()
    assert (settings.kv_connector, settings.shared_storage.path) == ("shared_storage", tmp_path / "store")
    code, out, err = check(capsys)
    assert code == 0, err
    assert out.startswith("ok: connector shared_storage")


def test_a_bad_kvdi_key_in_kvdi_kv_transfer_config_names_the_key(
    kvdi_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDI_KV_TRANSFER_CONFIG", json.dumps(serve_config(tmp_path, **{"allocator.block_size": 0})))
    with pytest.raises(
        ConfigError, match=r"allocator\.block_size \(KVDI_KV_TRANSFER_CONFIG key kvdi\.allocator\.block_size=0\)"
    ):
        load_settings()
