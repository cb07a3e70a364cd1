"""kvdi settings from vLLM's config (kvdi.integrations.vllm.config), without vLLM."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvdi.errors import ConfigError
from kvdi.integrations.vllm.config import kvdi_settings_kwargs, needs_block_index, settings_overrides
from kvdi.registry import ConnectorRegistry
from kvdi.settings import load_settings


def test_extra_config_keys_become_nested_settings() -> None:
    extra = {
        "kvdi.kv_connector": "redis",
        "kvdi.redis.url": "redis://h:1/0",
        "shared_storage_path": "/x",
        "kvdi": {"cpu_offload": {"max_bytes": 5}},
    }
    assert settings_overrides(extra) == {
        "kv_connector": "redis",
        "redis": {"url": "redis://h:1/0"},
        "cpu_offload": {"max_bytes": 5},
    }


def test_extra_config_value_and_section_clash_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"kvdi\.redis"):
        settings_overrides({"kvdi.redis": "x", "kvdi.redis.url": "redis://h"})


def test_empty_dotted_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="names no kvdi setting"):
        settings_overrides({"kvdi.": 1})


def test_vllm_role_engine_id_and_report_policy_win() -> None:
    transfer = SimpleNamespace(
        kv_connector_extra_config={"kvdi.kv_role": "kv_both", "kvdi.shared_storage.path": "/tmp/kvdi-x"},
        kv_role="kv_consumer",
        engine_id="e1",
    )
    settings = load_settings(**kvdi_settings_kwargs(SimpleNamespace(kv_transfer_config=transfer)))
    assert (settings.kv_role, settings.engine_id, settings.kv_load_failure_policy) == ("kv_consumer", "e1", "recompute")
    assert str(settings.shared_storage.path) == "/tmp/kvdi-x"


def test_missing_kv_transfer_config_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="kv-transfer-config"):
        kvdi_settings_kwargs(SimpleNamespace(kv_transfer_config=None))


def test_extra_config_layers_over_kvdi_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_REDIS__KEY_PREFIX", "from-env:")
    monkeypatch.setenv("KVDI_REDIS__TTL_S", "60")
    settings = load_settings(**settings_overrides({"kvdi.redis.ttl_s": 5}))
    assert (settings.redis.key_prefix, settings.redis.ttl_s) == ("from-env:", 5)


@pytest.mark.parametrize(
    ("connector", "backend", "expected"),
    [("cpu_offload", "mp", True), ("cpu_offload", "uni", False), ("shared_storage", "mp", False)],
)
def test_block_index_only_for_process_local_connectors_split_from_the_scheduler(
    connector: str, backend: str, expected: bool
) -> None:
    spec = ConnectorRegistry().get(connector).spec
    config: Any = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend))
    assert needs_block_index(spec, config) is expected
