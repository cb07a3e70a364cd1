"""Registry: lazy resolution, entry points, module path, duplicates and role checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvdi.connectors.base import SchedulerConnector, WorkerConnector
from kvdi.errors import ConnectorImportError, ConnectorTypeError, DuplicateConnectorError, UnknownConnectorError
from kvdi.registry import ConnectorRegistry, ConnectorSpec
from tests.helpers.registry import CONNECTOR_MODULE, install_entry_point, write_module

NULL_S = "kvdi.connectors.null:NullSchedulerConnector"
NULL_W = "kvdi.connectors.null:NullWorkerConnector"


def test_builtins_are_listed_without_importing_connector_modules() -> None:
    code = (
        "import sys; from kvdi.registry import ConnectorRegistry; r = ConnectorRegistry(); "
        "print(','.join(r.names())); "
        "assert not [m for m in sys.modules if m.startswith('kvdi.connectors.') and m != 'kvdi.connectors.base'], sys.modules; "
        "assert 'torch' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert {"null", "shared_storage", "cpu_offload", "redis", "multi", "p2p"} <= set(out.strip().split(","))


def test_resolve_imports_and_checks_both_role_classes() -> None:
    resolved = ConnectorRegistry().resolve("null")
    assert issubclass(resolved.scheduler_cls, SchedulerConnector)
    assert issubclass(resolved.worker_cls, WorkerConnector)
    assert resolved.origin == "builtin"


def test_same_target_twice_is_a_noop() -> None:
    reg = ConnectorRegistry(specs=())
    reg.register(ConnectorSpec("x", NULL_S, NULL_W))
    reg.register(ConnectorSpec("x", NULL_S, NULL_W))
    assert reg.names().count("x") == 1


def test_same_name_with_another_target_raises() -> None:
    reg = ConnectorRegistry(specs=())
    reg.register(ConnectorSpec("x", NULL_S, NULL_W))
    with pytest.raises(DuplicateConnectorError, match="'x' is already registered"):
        reg.register(ConnectorSpec("x", NULL_S, "other.mod:Worker"))


def test_class_of_the_wrong_role_is_a_type_error() -> None:
    reg = ConnectorRegistry(specs=[ConnectorSpec("swapped", NULL_W, NULL_S)])
    with pytest.raises(TypeError, match="NullWorkerConnector must be a subclass of .*SchedulerConnector"):
        reg.resolve("swapped")


def test_import_error_names_module_class_and_cause() -> None:
    reg = ConnectorRegistry(specs=[ConnectorSpec("ghost", "no_such_pkg.mod:Sched", NULL_W)])
    with pytest.raises(ConnectorImportError) as err:
        reg.resolve("ghost")
    text = str(err.value)
    assert "'Sched'" in text and "'no_such_pkg.mod'" in text and "ModuleNotFoundError" in text


def test_missing_class_in_existing_module_is_an_import_error() -> None:
    reg = ConnectorRegistry(specs=[ConnectorSpec("ghost", "kvdi.connectors.null:Nope", NULL_W)])
    with pytest.raises(ConnectorImportError, match="'Nope' from module 'kvdi.connectors.null'.*AttributeError"):
        reg.resolve("ghost")


def test_unknown_name_lists_registered_names_and_suggests() -> None:
    with pytest.raises(UnknownConnectorError) as err:
        ConnectorRegistry().get("shared_storag")
    assert "registered: cpu_offload, multi, null" in str(err.value)
    assert "did you mean 'shared_storage'" in str(err.value)


def test_two_registries_are_independent() -> None:
    a, b = ConnectorRegistry(specs=()), ConnectorRegistry(specs=())
    a.register(ConnectorSpec("only-a", NULL_S, NULL_W))
    assert "only-a" in a.names() and "only-a" not in b.names()


def test_module_path_with_a_spec_is_imported_only_when_selected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_module(tmp_path, CONNECTOR_MODULE + '\nSPEC = ConnectorSpec("mine", "{m}:MySched", "{m}:MyWorker")\n')
    path = tmp_path / f"{name}.py"
    path.write_text("from kvdi.registry import ConnectorSpec\n" + path.read_text().replace("{m}", name))
    reg = ConnectorRegistry()
    assert name not in sys.modules
    reg.get("null")
    assert name not in sys.modules
    resolved = reg.resolve("mine", module_path=name)
    assert name in sys.modules
    assert (resolved.scheduler_cls.__name__, resolved.worker_cls.__name__, resolved.origin) == (
        "MySched",
        "MyWorker",
        "module-path",
    )


def test_module_path_with_a_single_vllm_style_class_serves_both_roles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_module(tmp_path, CONNECTOR_MODULE)
    resolved = ConnectorRegistry().resolve("DualRole", module_path=name)
    assert resolved.scheduler_cls is resolved.worker_cls
    assert resolved.scheduler_cls.__name__ == "DualRole"


def test_module_path_without_the_named_class_is_an_import_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    name = write_module(tmp_path, CONNECTOR_MODULE)
    with pytest.raises(ConnectorImportError, match="no ConnectorSpec and no class named 'Missing'"):
        ConnectorRegistry().resolve("Missing", module_path=name)


def test_entry_point_connector_is_listed_lazily_and_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    impl = write_module(tmp_path, CONNECTOR_MODULE)
    spec_mod = write_module(
        tmp_path,
        f'from kvdi.registry import ConnectorSpec\nSPEC = ConnectorSpec("ep", "{impl}:MySched", "{impl}:MyWorker")\n',
    )
    install_entry_point(tmp_path, "from_ep", spec_mod, "SPEC")
    reg = ConnectorRegistry()
    assert "from_ep" in reg.names()
    assert spec_mod not in sys.modules and impl not in sys.modules
    resolved = reg.resolve("from_ep")
    assert resolved.origin == "entry-point" and resolved.spec.name == "from_ep"
    assert impl in sys.modules


def test_entry_point_that_is_not_a_spec_is_a_type_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = write_module(tmp_path, "NOT_A_SPEC = 42\n")
    install_entry_point(tmp_path, "bad_ep", mod, "NOT_A_SPEC")
    with pytest.raises(ConnectorTypeError, match="must be a kvdi ConnectorSpec, got int"):
        ConnectorRegistry().resolve("bad_ep")


def test_only_cpu_offload_is_process_local() -> None:
    reg = ConnectorRegistry(entry_points=False)
    assert [n for n in reg.names() if reg.get(n).spec.process_local] == ["cpu_offload"]


def test_a_renamed_entry_point_spec_keeps_every_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    impl = write_module(tmp_path, CONNECTOR_MODULE)
    spec_mod = write_module(
        tmp_path,
        "from kvdi.registry import ConnectorSpec\n"
        f'SPEC = ConnectorSpec("x", "{impl}:MySched", "{impl}:MyWorker", process_local=True, requires=("zlib",))\n',
    )
    install_entry_point(tmp_path, "renamed", spec_mod, "SPEC")
    spec = ConnectorRegistry().get("renamed").spec
    assert (spec.name, spec.process_local, spec.requires) == ("renamed", True, ("zlib",))


def test_store_connectors_are_the_store_halves_over_a_backend() -> None:
    reg = ConnectorRegistry(entry_points=False)
    assert reg.store_names() == ["cpu_offload", "redis", "shared_storage"]
    assert reg.resolve_store("redis", "X").spec.name == "redis"
