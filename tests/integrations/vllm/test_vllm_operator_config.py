"""An operator's vLLM config, without vLLM: the load-failure policy kvdi hands vLLM, keys that look like kvdi's but
are not, and errors that name what the user wrote (issue 32)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvdi.cli import main
from kvdi.containers import build_kv_container
from kvdi.errors import BackendUnavailableError, ConfigError, UnknownConnectorError
from kvdi.integrations.vllm.config import (
    adopt_load_failure_policy,
    kvdi_settings_kwargs,
    renamed_for_transfer_config,
    settings_overrides,
)
from kvdi.settings import load_settings


def vllm_config(extra: dict[str, Any], policy: str = "fail") -> SimpleNamespace:
    """vLLM's config as the adapter sees it: a KVTransferConfig whose ``kv_load_failure_policy`` is vLLM's default."""
    transfer = SimpleNamespace(
        kv_connector_extra_config=extra, kv_role="kv_both", engine_id="e1", kv_load_failure_policy=policy
    )
    return SimpleNamespace(kv_transfer_config=transfer)


def serve_json(extra: dict[str, Any], **top: Any) -> str:
    return json.dumps(
        {"kv_connector": "KvdiConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra, **top}
    )


def test_vllm_default_fail_policy_becomes_kvdis_recompute(kvdi_env: Path, tmp_path: Path) -> None:
    """A server whose transfer config leaves the policy out (vLLM's default ``fail``) recomputes a bad stored block."""
    config = vllm_config({"kvdi.kv_connector": "shared_storage", "kvdi.shared_storage.path": str(tmp_path)})
    assert adopt_load_failure_policy(config) == "recompute"
    assert config.kv_transfer_config.kv_load_failure_policy == "recompute"


def test_kvdi_fail_policy_is_handed_to_vllm(kvdi_env: Path, tmp_path: Path) -> None:
    """``kvdi.kv_load_failure_policy: fail`` is what vLLM applies, even over vLLM's explicit ``recompute``."""
    extra = {"kvdi.shared_storage.path": str(tmp_path), "kvdi.kv_load_failure_policy": "fail"}
    config = vllm_config(extra, policy="recompute")
    assert adopt_load_failure_policy(config) == "fail"
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("kvd.shared_storage.path", "kvdi.shared_storage.path"),
        ("KVDI.shared_storage.path", "kvdi.shared_storage.path"),
        ("kvdi_shared_storage.path", "kvdi.shared_storage.path"),
        ("kvdi_stat_dir", "kvdi_stats_dir"),
    ],
)
def test_a_key_that_looks_like_kvdis_is_refused_with_did_you_mean(key: str, meant: str) -> None:
    """A misspelt kvdi prefix is an error naming the key and the key meant, not a silently ignored setting."""
    with pytest.raises(ConfigError, match=f"{key!r}.*did you mean {meant!r}"):
        settings_overrides({key: "/x"})


def test_other_connectors_keys_still_pass() -> None:
    """Keys of vLLM and other connectors (no kvdi look) are left alone."""
    extra = {
        "connectors": [],
        "lmcache.chunk_size": 256,
        "kv_buffer_size": 1,
        "backends": ["UCX"],
        "kvdi_stats_dir": "/s",
    }
    assert settings_overrides(extra) == {}


def test_kvdi_check_refuses_a_prefix_typo(kvdi_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kvdi check --vllm-config`` exits 2 with one line naming the misspelt key and the right one."""
    code = main(["check", "--vllm-config", serve_json({"kvd.shared_storage.path": str(tmp_path)})])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "'kvd.shared_storage.path'" in err and "'kvdi.shared_storage.path'" in err


def test_kvdi_check_says_a_bad_object_is_a_miss(
    kvdi_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The documented command (no vLLM policy key) is reported as recomputing a bad stored object."""
    extra = {"kvdi.kv_connector": "shared_storage", "kvdi.shared_storage.path": str(tmp_path)}
    assert main(["check", "--vllm-config", serve_json(extra)]) == 0
    assert "on a bad or missing stored object: a miss, the engine recomputes it" in capsys.readouterr().out


def test_kvdi_check_warns_that_a_multiconnector_without_policy_fails(
    kvdi_env: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under MultiConnector vLLM reads the parent's policy, which kvdi cannot set: check says the request fails."""
    child = {
        "kv_connector": "KvdiConnector",
        "kv_connector_extra_config": {"kvdi.kv_connector": "shared_storage", "kvdi.shared_storage.path": str(tmp_path)},
    }
    config = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [child]}}
    assert main(["check", "--vllm-config", json.dumps(config)]) == 0
    out = capsys.readouterr().out
    assert "vLLM FAILS the request (HTTP 500)" in out and '"kv_load_failure_policy": "recompute"' in out


def test_a_bad_extra_config_value_at_start_names_the_transfer_config_key(kvdi_env: Path) -> None:
    """The adapter's validation error names ``--kv-transfer-config key kvdi.shared_storage.pth``, not KVDI_*."""
    config = vllm_config({"kvdi.shared_storage.pth": "/x"})
    with pytest.raises(ConfigError) as caught:
        build_kv_container(**kvdi_settings_kwargs(config))
    text = str(renamed_for_transfer_config(caught.value, config))
    assert "--kv-transfer-config key kvdi.shared_storage.pth" in text and "KVDI_SHARED_STORAGE__PTH" not in text


def test_a_backend_failure_at_start_names_the_transfer_config_key(kvdi_env: Path) -> None:
    """A backend error naming ``KVDI_REDIS__URL`` is reworded to the extra-config key the user wrote."""
    config = vllm_config({"kvdi.kv_connector": "redis", "kvdi.redis.url": "redis://127.0.0.1:1"})
    error = BackendUnavailableError("KVDI_REDIS__URL=redis://127.0.0.1:1: redis server cannot serve: unreachable")
    text = str(renamed_for_transfer_config(error, config))
    assert text.startswith("--kv-transfer-config key kvdi.redis.url=redis://127.0.0.1:1: redis server cannot serve")


def test_a_setting_from_env_keeps_its_variable_name(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only settings the transfer config sets are renamed; one from ``KVDI_*`` env keeps its variable."""
    monkeypatch.setenv("KVDI_REDIS__URL", "redis://127.0.0.1:1")
    config = vllm_config({"kvdi.kv_connector": "redis"})
    error = BackendUnavailableError("KVDI_REDIS__URL=redis://127.0.0.1:1: unreachable")
    assert str(renamed_for_transfer_config(error, config)).startswith("KVDI_REDIS__URL=")


def test_a_keyword_argument_error_names_the_keyword(kvdi_env: Path) -> None:
    """``build_kv_container(kv_connector=...)`` with an unknown name blames the keyword argument, not KVDI_KV_CONNECTOR."""
    with pytest.raises(UnknownConnectorError) as caught:
        build_kv_container(kv_connector="shared_storag")
    assert str(caught.value).startswith("keyword argument kv_connector='shared_storag' is not a registered connector")


def test_a_bad_keyword_value_names_the_keyword(kvdi_env: Path) -> None:
    """A validation error of ``load_settings(shared_storage={...})`` names ``keyword argument shared_storage.max_bytes``."""
    with pytest.raises(ConfigError, match=r"keyword argument shared_storage\.max_bytes=-5"):
        load_settings(shared_storage={"max_bytes": -5})
