"""Registry: lazy resolution, entry points, module path, duplicates and role checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvdi.connectors.base import SchedulerConnector, WorkerConnector
from kvdi.errors import (
    ConfigError,
    ConnectorImportError,
    ConnectorTypeError,
    DuplicateConnectorError,
    UnknownConnectorError,
)
from kvdi.registry import ConnectorRegistry, ConnectorSpec
from tests.helpers.registry import CONNECTOR_MODULE, install_entry_point, write_module

NULL_S = "kvdi.connectors.null:NullSchedulerConnector"
NULL_W = "kvdi.connectors.null:NullWorkerConnector"


def test_builtins_are_listed_without_importing_connector_modules() -> None:
    """Listing names imports no connector module (and not torch); every listed built-in then resolves."""
    code = (
        "import sys; from kvdi.registry import ConnectorRegistry; r = ConnectorRegistry(entry_points=False); "
        "print(','.join(r.names())); "
        "assert not [m for m in sys.modules if m.startswith('kvdi.connectors.') and m != 'kvdi.connectors.base'], sys.modules; "
        "assert 'torch' not in sys.modules"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    names = out.strip().split(",")
    assert len(names) >= 2
    reg = ConnectorRegistry(entry_points=False)
    for name in names:
        if not reg.get(name).missing_requirements:
            assert reg.resolve(name).spec.name == name


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
    assert f"registered: {', '.join(ConnectorRegistry().names())}" in str(err.value)
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


STORE_S = "kvdi.connectors.store:StoreSchedulerConnector"
STORE_W = "kvdi.connectors.store:StoreWorkerConnector"
POOL = "kvdi.connectors.cpu_offload:open_store"


def test_a_store_connector_is_the_store_halves_over_a_backend_whatever_its_name() -> None:
    """The spec decides: store halves + a backend is a store (a tier), with tiers it is not, null is not."""
    reg = ConnectorRegistry(
        specs=[
            ConnectorSpec("mine", STORE_S, STORE_W, backend=POOL),
            ConnectorSpec("local", STORE_S, STORE_W, backend=POOL, process_local=True),
            ConnectorSpec("layered", STORE_S, STORE_W, backend=POOL, tiers="tiers"),
            ConnectorSpec("plain", NULL_S, NULL_W),
        ],
        entry_points=False,
    )
    assert reg.store_names() == ["local", "mine"]
    assert reg.resolve_store("mine", "X").spec.name == "mine"
    with pytest.raises(ConfigError, match="X names 'layered', which is not a store connector"):
        reg.resolve_store("layered", "X")
    with pytest.raises(ConfigError, match="X names 'nope', which is not a registered connector"):
        reg.resolve_store("nope", "X")
    slices = {n: reg.resolve(n).stores_rank_slices for n in ("mine", "local", "layered", "plain")}
    assert slices == {"mine": True, "local": False, "layered": True, "plain": False}


def test_a_missing_requirement_names_the_specs_install_hint() -> None:
    """A backend importing a package the spec requires, absent here: the error says what to pip install."""
    reg = ConnectorRegistry(
        specs=[
            ConnectorSpec(
                "needy",
                NULL_S,
                NULL_W,
                backend="no_such_pkg_kvdi.sub:open",
                requires=("no_such_pkg_kvdi",),
                install="kvdi-needy[extra]",
            ),
            ConnectorSpec("bare", NULL_S, NULL_W, backend="no_such_pkg_kvdi:open", requires=("no_such_pkg_kvdi",)),
            ConnectorSpec(
                "unrelated", NULL_S, NULL_W, backend="other_missing_pkg:open", requires=("no_such_pkg_kvdi",)
            ),
        ],
        entry_points=False,
    )
    assert reg.get("needy").missing_requirements == ("no_such_pkg_kvdi",)
    with pytest.raises(ConnectorImportError, match=r"pip install 'kvdi-needy\[extra\]'"):
        reg.resolve("needy")
    with pytest.raises(ConnectorImportError, match="pip install 'no_such_pkg_kvdi'"):
        reg.resolve("bare")
    with pytest.raises(ConnectorImportError) as err:
        reg.resolve("unrelated")
    assert "pip install" not in str(err.value)


def test_connector_type_error_is_exported_and_is_a_type_error() -> None:
    import kvdi

    assert kvdi.ConnectorTypeError is ConnectorTypeError and issubclass(ConnectorTypeError, TypeError)
