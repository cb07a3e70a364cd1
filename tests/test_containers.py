"""Containers: selection by settings, V1 gate, role split, coexistence, module-path and entry-point connectors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvdi.connectors.base import KVConnectorRole, SchedulerConnector, WorkerConnector, require_role
from kvdi.containers import build_engine_container, build_kv_container
from kvdi.errors import ConnectorTypeError, UnknownConnectorError, V1EngineRequiredError
from kvdi.registry import ConnectorRegistry, ConnectorSpec
from tests.helpers.registry import CONNECTOR_MODULE, install_entry_point, write_module


def test_container_builds_both_halves_of_the_selected_connector(kvdi_env: Path) -> None:
    c = build_kv_container(kv_connector="null")
    sched, work = c.scheduler_connector(), c.worker_connector()
    assert isinstance(sched, SchedulerConnector) and sched.role is KVConnectorRole.SCHEDULER
    assert isinstance(work, WorkerConnector) and work.role is KVConnectorRole.WORKER
    assert sched.name == work.name == "null"


def test_env_selects_the_connector(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_KV_CONNECTOR", "null")
    assert build_kv_container().connector().spec.name == "null"


def test_unknown_connector_fails_at_build_time(kvdi_env: Path) -> None:
    with pytest.raises(UnknownConnectorError, match="did you mean 'cpu_offload'"):
        build_kv_container(kv_connector="cpu_ofload")


@pytest.mark.parametrize("var", ["KVDI_USE_V1", "VLLM_USE_V1"])
def test_v1_gate_refuses_to_build_and_names_both_env_vars(
    kvdi_env: Path, monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    monkeypatch.setenv(var, "0")
    with pytest.raises(V1EngineRequiredError) as err:
        build_kv_container(kv_connector="null")
    text = str(err.value)
    assert f"{var}=0" in text and "KVDI_USE_V1=1" in text and "VLLM_USE_V1" in text


def test_v1_gate_also_guards_an_unvalidated_container(kvdi_env: Path) -> None:
    from kvdi.containers import KVTransferContainer
    from kvdi.settings import load_settings

    c = KVTransferContainer(settings=load_settings(kv_connector="null", use_v1=False))
    with pytest.raises(V1EngineRequiredError):
        c.worker_connector()


def test_two_containers_with_different_settings_coexist(kvdi_env: Path, tmp_path: Path) -> None:
    a = build_kv_container(kv_connector="null", kv_role="kv_producer")
    b = build_kv_container(kv_connector="null", kv_role="kv_consumer")
    assert a.worker_connector().context.settings.kv_role == "kv_producer"
    assert b.worker_connector().context.settings.kv_role == "kv_consumer"
    assert a.worker_connector().context.engine_id != b.worker_connector().context.engine_id


def test_containers_can_hold_different_registries(kvdi_env: Path) -> None:
    reg = ConnectorRegistry(
        specs=[
            ConnectorSpec(
                "custom", "kvdi.connectors.null:NullSchedulerConnector", "kvdi.connectors.null:NullWorkerConnector"
            )
        ]
    )
    assert build_kv_container(kv_connector="custom", registry=reg).worker_connector().name == "custom"
    with pytest.raises(UnknownConnectorError):
        build_kv_container(kv_connector="custom")


def test_module_path_connector_is_built_and_imported_only_when_selected(
    kvdi_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = write_module(tmp_path, CONNECTOR_MODULE)
    build_kv_container(kv_connector="null").worker_connector()
    assert mod not in sys.modules
    monkeypatch.setenv("KVDI_KV_CONNECTOR", "DualRole")
    monkeypatch.setenv("KVDI_KV_CONNECTOR_MODULE_PATH", mod)
    c = build_kv_container()
    sched, work = c.scheduler_connector(), c.worker_connector()
    assert type(sched).__name__ == type(work).__name__ == "DualRole"
    assert (sched.role, work.role) == (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
    assert mod in sys.modules


def test_entry_point_connector_is_built_and_imported_only_when_selected(
    kvdi_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    impl = write_module(tmp_path, CONNECTOR_MODULE)
    spec_mod = write_module(
        tmp_path,
        f'from kvdi.registry import ConnectorSpec\nSPEC = ConnectorSpec("x", "{impl}:MySched", "{impl}:MyWorker")\n',
    )
    install_entry_point(tmp_path, "plugin_conn", spec_mod, "SPEC")
    build_kv_container(kv_connector="null").worker_connector()
    assert spec_mod not in sys.modules and impl not in sys.modules
    c = build_kv_container(kv_connector="plugin_conn")
    assert type(c.worker_connector()).__name__ == "MyWorker"
    assert c.connector().origin == "entry-point"
    assert impl in sys.modules


def test_dual_role_object_built_for_one_role_is_refused_for_the_other(kvdi_env: Path) -> None:
    c = build_kv_container(kv_connector="null")
    require_role(c.worker_connector(), KVConnectorRole.WORKER, "Worker")
    with pytest.raises(
        ConnectorTypeError,
        match="Scheduler needs a SchedulerConnector built for role SCHEDULER, got NullWorkerConnector",
    ):
        require_role(c.worker_connector(), KVConnectorRole.SCHEDULER, "Scheduler")


@pytest.fixture
def kvdi_overrides(tmp_path: Path) -> dict[str, object]:
    """This module's isolated containers use the null connector (overriding the plugin's fixture)."""
    return {"kv_connector": "null", "allocator": {"device": "cpu", "num_blocks": 16}}


def test_engine_components_receive_their_own_half_and_the_allocator(kvdi_container) -> None:  # type: ignore[no-untyped-def]
    c = kvdi_container
    scheduler, worker = c.scheduler(), c.worker()
    assert isinstance(scheduler.connector, SchedulerConnector) and scheduler.connector.role is KVConnectorRole.SCHEDULER
    assert isinstance(worker.connector, WorkerConnector) and worker.connector.role is KVConnectorRole.WORKER
    allocated = c.alloc.allocator().kv_caches
    assert set(worker.kv_caches) == set(c.alloc.layout().layer_names)
    assert all(worker.kv_caches[name] is allocated[name] for name in allocated)


def test_scheduler_component_refuses_a_worker_half(kvdi_container) -> None:  # type: ignore[no-untyped-def]
    c = kvdi_container
    with (
        c.kv.scheduler_connector.override(c.kv.worker_connector),
        pytest.raises(ConnectorTypeError, match="Scheduler needs"),
    ):
        c.scheduler()


def test_worker_component_refuses_a_scheduler_half(kvdi_container) -> None:  # type: ignore[no-untyped-def]
    c = kvdi_container
    with (
        c.kv.worker_connector.override(c.kv.scheduler_connector),
        pytest.raises(ConnectorTypeError, match="Worker needs"),
    ):
        c.worker()


def test_scheduler_graph_never_allocates_the_kv_cache(kvdi_container) -> None:  # type: ignore[no-untyped-def]
    c = kvdi_container
    c.scheduler()
    assert c.alloc.planner().kv_caches == {}


def test_engine_container_validates_the_plan_at_build_time(kvdi_env: Path) -> None:
    from kvdi.errors import AllocationError

    with pytest.raises(AllocationError, match="no KV block fits"):
        build_engine_container(kv_connector="null", allocator={"device": "cpu", "memory_fraction": 1e-12})


def test_shutdown_resources_shuts_down_both_connector_halves(kvdi_container) -> None:  # type: ignore[no-untyped-def]
    from kvdi.testing import override_connector, recording_halves

    c = kvdi_container
    sched, worker, log = recording_halves(c)
    with override_connector(c, scheduler=sched, worker=worker):
        c.engine()
    c.shutdown_resources()
    assert log.methods().count("shutdown") == 2
    assert c.alloc.planner().kv_caches == {}


def test_a_store_worker_half_takes_its_staging_from_the_engine_allocator(kvdi_env: Path, tmp_path: Path) -> None:
    import torch

    model = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
             "intermediate_size": 128, "vocab_size": 256, "max_model_len": 512}  # fmt: skip
    c = build_engine_container(
        kv_connector="shared_storage",
        model=model,
        allocator={"device": "cpu", "num_blocks": 4, "block_size": 16},
        shared_storage={"path": str(tmp_path / "kv")},
    )
    try:
        worker, alloc = c.kv.worker_connector(), c.alloc.allocator()
        assert worker.context.staging == alloc.staging
        assert c.kv.scheduler_connector().context.staging is None  # the scheduler half never touches memory
        layout = c.alloc.layout()
        assert layout.block_bytes == 8192
        # A cache that is not on the CPU (here: torch's meta device) is staged through host memory.
        off_cpu = {n: torch.empty((4, *layout.block_shape), device="meta") for n in layout.layer_names}
        worker.register_kv_caches(off_cpu)
        # a ring of two chunks of the cache's 4 blocks and their block ids; no device memory before a copy
        assert alloc.staging_nbytes == {"cpu": 2 * 4 * (8192 + 8)}
    finally:
        c.shutdown_resources()
    assert alloc.staging_nbytes == {}


def test_a_kv_container_alone_stages_through_its_own_counted_buffers(kvdi_env: Path) -> None:
    from kvdi.allocator import StagingBuffers

    c = build_kv_container(kv_connector="null", allocator={"pin_memory": False})
    staging = c.worker_connector().context.staging
    assert isinstance(staging, StagingBuffers) and staging is c.staging() and not staging.pin_memory
