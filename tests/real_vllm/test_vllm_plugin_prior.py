"""A connector registered under the name ``KvdiConnector`` by another plugin first (issue 28, item 6): kvdi's
plugin leaves it and says so in one log line naming it; kvdi's own earlier registration stays silent."""

from __future__ import annotations

import logging

import pytest

from tests.real_vllm.vllm_support import require_vllm

require_vllm()


def test_a_prior_registration_by_someone_else_is_logged_in_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvdi.integrations.vllm.plugin import CONNECTOR_NAME, register

    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory._registry.pop(CONNECTOR_NAME, None)
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "other_plugin.connectors", "TheirConnector")
    with caplog.at_level(logging.WARNING, logger="kvdi.integrations.vllm.plugin"):
        register()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvdi.integrations.vllm.plugin"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "other_plugin.connectors:TheirConnector" in lines[0] and "kv_connector_module_path" in lines[0]


def test_kvdis_own_earlier_registration_is_silent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvdi.integrations.vllm.plugin import CONNECTOR_NAME, register

    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    KVConnectorFactory._registry.pop(CONNECTOR_NAME, None)
    with caplog.at_level(logging.WARNING, logger="kvdi.integrations.vllm.plugin"):
        register()
        register()
    assert not [r for r in caplog.records if r.name == "kvdi.integrations.vllm.plugin"]
