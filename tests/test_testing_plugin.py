"""kvdi's pytest plugin as a user meets it: fixtures, overrides undone after the test, recording."""

from __future__ import annotations

import pytest

INNER = """
import pytest
from kvdi.containers import build_kv_container
from kvdi.testing import RecordingWorkerConnector, recording_halves


@pytest.fixture(scope="module")
def shared():
    return build_kv_container(kv_connector="null")


def test_override_with_recording_worker(shared, kvdi_override):
    sched, worker, log = recording_halves(shared)
    kvdi_override(shared, worker=worker)
    got = shared.worker_connector()
    assert got is worker
    got.register_kv_caches({})
    got.start_load_kv()
    got.wait_for_save()
    assert log.methods("worker") == ["register_kv_caches", "start_load_kv", "wait_for_save"]


def test_override_is_gone_in_the_next_test(shared):
    assert not isinstance(shared.worker_connector(), RecordingWorkerConnector)
    assert shared.worker_connector.overridden == ()


def test_isolated_container_uses_cpu_and_a_temp_store(kvdi_container, tmp_path):
    s = kvdi_container.settings()
    assert s.allocator.device == "cpu"
    assert str(tmp_path) in str(s.shared_storage.path)


def test_kvdi_env_clears_kvdi_variables(kvdi_env):
    import os
    assert not [k for k in os.environ if k.startswith("KVDI_")]
"""


def test_plugin_fixtures_and_overrides(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_KV_ROLE", "kv_both")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


@pytest.fixture
def kvdi_overrides() -> dict[str, object]:
    """This module's isolated containers: null connector, small pool (overrides the plugin's fixture)."""
    return {"kv_connector": "null", "allocator": {"device": "cpu", "num_blocks": 64}}


def test_recording_worker_sees_one_step_in_contract_order(kvdi_container, kvdi_override) -> None:  # type: ignore[no-untyped-def]
    from kvdi.testing import recording_halves

    sched, worker, log = recording_halves(kvdi_container)
    kvdi_override(kvdi_container, scheduler=sched, worker=worker)
    kvdi_container.engine().generate([[5, 6, 7] * 12], max_new_tokens=1)
    calls = log.methods("worker")
    layers = kvdi_container.alloc.layout().layer_names
    assert calls[0] == "register_kv_caches"
    first_step = calls[1 : calls.index("clear_connector_metadata") + 1]
    assert first_step == [
        "bind_connector_metadata",
        "start_load_kv",
        "get_block_ids_with_load_errors",
        *["wait_for_layer_load", "save_kv_layer"] * len(layers),
        "wait_for_save",
        "get_finished",
        "clear_connector_metadata",
    ]
    assert log.methods("scheduler")[:2] == ["get_num_new_matched_tokens", "update_state_after_alloc"]
    assert "request_finished" in log.methods("scheduler")
