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
