"""validate_container: a kvdi container composed into an app is checked up front, not on first use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dependency_injector import containers, providers

from kvdi.containers import EngineContainer, KVTransferContainer, validate_container
from kvdi.errors import ConfigError, V1EngineRequiredError
from kvdi.settings import load_settings


def make_app(tmp_path: Path, **overrides: Any) -> Any:
    """An application container composing a kvdi engine and a bare kv container, as users write it."""
    settings = {"shared_storage": {"path": str(tmp_path / "kv")}, "allocator": {"device": "cpu", "num_blocks": 32}}

    class Services(containers.DeclarativeContainer):
        kv_settings = providers.Singleton(load_settings, **settings)
        kv = providers.Container(KVTransferContainer, settings=kv_settings)

    class App(containers.DeclarativeContainer):
        engine_settings = providers.Singleton(load_settings, **{**settings, **overrides})
        engine = providers.Container(EngineContainer, settings=engine_settings)
        services = providers.Container(Services)

    return App()


def test_a_misspelt_connector_passes_app_creation_and_fails_validation(kvdi_env: Path, tmp_path: Path) -> None:
    """create_app() alone resolves nothing; validate_container(app) names the setting and suggests the fix."""
    app = make_app(tmp_path, kv_connector="shared_storge")
    with pytest.raises(ConfigError, match="shared_storge.*did you mean 'shared_storage'"):
        validate_container(app)
    with pytest.raises(ConfigError, match="shared_storge"):
        validate_container(app.engine)


def test_every_kvdi_container_of_an_app_is_checked_at_any_depth(kvdi_env: Path, tmp_path: Path) -> None:
    """The engine and the kv container nested one app deeper: two checked, nothing allocated or opened."""
    app = make_app(tmp_path)
    assert validate_container(app) == 2
    assert validate_container(app.services.kv) == 1
    assert not (tmp_path / "kv").exists()  # the backend was not opened


def test_bad_settings_and_the_v1_gate_fail_validation(kvdi_env: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        validate_container(make_app(tmp_path, allocator={"block_size": 0}))
    with pytest.raises(V1EngineRequiredError):
        validate_container(make_app(tmp_path, use_v1=False))


def test_a_container_without_kvdi_is_a_type_error() -> None:
    class Other(containers.DeclarativeContainer):
        value = providers.Object(1)

    with pytest.raises(TypeError, match="holds no kvdi"):
        validate_container(Other())


def test_the_prefill_decode_pair_validates_both_engines(kvdi_env: Path, tmp_path: Path) -> None:
    """The runnable app of containers/ checks both halves before running anything."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "containers" / "prefill_decode_pair.py"
    spec = importlib.util.spec_from_file_location("pair_for_validation", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    app = module.PrefillDecodePair()
    app.config.from_dict({"store_dir": str(tmp_path), "num_blocks": 32})
    assert validate_container(app) == 2
