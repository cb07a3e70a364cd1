"""``kvdi_events_identity``, the shared identity of kvdi's events for shared tiers: read from vLLM's extra config,
checked with a one-line error, and the topic it makes (vLLM-free; the events themselves: real_vllm's
``test_vllm_shared_events``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvdi.errors import ConfigError
from kvdi.integrations.vllm.config import events_identity, parse_events_identity, shared_topic
from kvdi.settings.vllm_compat import extra_config_overrides


def _config(extra: dict[str, object]) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


@pytest.mark.parametrize("value", ["pool:fleet", "node:gpu-node-7.example.com", "pool:s3_l2-v1"])
def test_pool_and_node_identities_are_read(value: str) -> None:
    assert events_identity(_config({"kvdi_events_identity": value})) == value


@pytest.mark.parametrize("extra", [{}, {"kvdi_events_identity": ""}, {"kvdi_events_identity": "off"}])
def test_off_by_default(extra: dict[str, object]) -> None:
    assert events_identity(_config(extra)) is None
    assert events_identity(SimpleNamespace(kv_transfer_config=None)) is None


@pytest.mark.parametrize("value", ["fleet", "pool:", "pool:a@b", "cluster:x", "node: n", 3, ["pool:x"]])
def test_a_bad_identity_is_one_line_naming_the_key_the_value_and_what_is_allowed(value: object) -> None:
    with pytest.raises(ConfigError) as err:
        parse_events_identity(value)
    message = str(err.value)
    assert "\n" not in message
    assert "'kvdi_events_identity'" in message and repr(str(value)) in message
    assert "'pool:<name>' or 'node:<name>'" in message and "'off'" in message


def test_the_topic_is_vllms_with_the_identity_in_the_pods_place() -> None:
    """llm-d reads ``kv@<pod>@<model>``: the shared topic keeps vLLM's model segment; another shape gets kvdi's."""
    assert shared_topic("kv@10.1.2.3@llama-3", "pool:fleet", "served") == "kv@pool:fleet@llama-3"
    assert shared_topic("", "node:n1", "served") == "kv@node:n1@served"
    assert shared_topic("events", "pool:fleet", "served") == "kv@pool:fleet@served"


def test_the_key_is_kvdis_own_and_a_typo_of_it_is_caught() -> None:
    assert extra_config_overrides({"kvdi_events_identity": "pool:fleet"}) == {}
    with pytest.raises(ConfigError, match="did you mean 'kvdi_events_identity'"):
        extra_config_overrides({"kvdi_event_identity": "pool:fleet"})
