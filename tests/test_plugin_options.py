"""A plugin connector's options: its own model, set by ``KVDI_<NAME>__*``, ``kvdi.<name>.*`` extra config and the
settings file, shown by ``kvdi info`` with their sources; ``kvdi info`` shows only the selected connector's options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import BaseModel, Field

from kvdi.containers import build_kv_container
from kvdi.errors import ConfigError
from kvdi.integrations.vllm.config import kvdi_settings_kwargs
from kvdi.registry import ConnectorRegistry, ConnectorSpec
from kvdi.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
NULL = "kvdi.connectors.null"
PLUGIN = f'''
from pydantic import BaseModel, Field
from kvdi.registry import ConnectorSpec

class DepthOptions(BaseModel):
    depth: int = Field(3, ge=1, le=10)
    label: str = "plain"

SPEC = ConnectorSpec("deep", "{NULL}:NullSchedulerConnector", "{NULL}:NullWorkerConnector", settings="deep_plugin:DepthOptions")
'''


class DepthOptions(BaseModel):
    """The options model of the in-process plugin ``deep``."""

    depth: int = Field(3, ge=1, le=10)
    label: str = "plain"


def registry() -> ConnectorRegistry:
    """A registry with the plugin ``deep`` registered by its spec (``settings=`` the model class)."""
    reg = ConnectorRegistry(entry_points=False)
    reg.register(
        ConnectorSpec("deep", f"{NULL}:NullSchedulerConnector", f"{NULL}:NullWorkerConnector", settings=DepthOptions)
    )
    return reg


def kvdi(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the real ``kvdi`` CLI with the plugin module ``deep_plugin`` importable and a clean KVDI_* environment."""
    (tmp_path / "deep_plugin.py").write_text(PLUGIN)
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDI_") and k != "VLLM_USE_V1"}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    plugin = {"KVDI_KV_CONNECTOR": "deep", "KVDI_KV_CONNECTOR_MODULE_PATH": "deep_plugin"}
    return subprocess.run(
        [sys.executable, "-m", "kvdi.cli", *args],
        env={**base, **plugin, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_info_shows_a_plugin_option_set_by_its_variable_with_source_env(tmp_path: Path) -> None:
    """KVDI_DEEP__DEPTH reaches the plugin's model and ``kvdi info`` shows it as ``deep.depth`` from ``env``."""
    r = kvdi(tmp_path, "info", env={"KVDI_DEEP__DEPTH": "7"})
    assert r.returncode == 0, r.stderr
    assert "  deep.depth" in r.stdout and "= 7  [env]" in r.stdout
    assert '= "plain"  [default]' in r.stdout
    j = kvdi(tmp_path, "info", "--json", env={"KVDI_DEEP__DEPTH": "7"})
    rows = {row["setting"]: row for row in json.loads(j.stdout)["settings"]}
    assert rows["deep.depth"] == {"setting": "deep.depth", "value": 7, "source": "env"}
    assert rows["deep.label"]["source"] == "default"


def test_info_shows_a_plugin_option_from_the_settings_file(tmp_path: Path) -> None:
    """The profile's ``[deep]`` table sets the plugin's option; the environment's variable beats it."""
    profile = tmp_path / "p.toml"
    profile.write_text('[deep]\ndepth = 5\nlabel = "from-file"\n')
    r = kvdi(tmp_path, "info", "--json", env={"KVDI_SETTINGS_FILE": str(profile), "KVDI_DEEP__DEPTH": "9"})
    assert r.returncode == 0, r.stderr
    rows = {row["setting"]: row for row in json.loads(r.stdout)["settings"]}
    assert (rows["deep.depth"]["value"], rows["deep.depth"]["source"]) == (9, "env")
    assert (rows["deep.label"]["value"], rows["deep.label"]["source"]) == ("from-file", "file")


def test_a_bad_plugin_option_is_one_line_naming_the_variable(tmp_path: Path) -> None:
    """An out-of-bounds value exits 2 with one line naming the variable, the value and the bound."""
    r = kvdi(tmp_path, "info", env={"KVDI_DEEP__DEPTH": "70"})
    assert r.returncode == 2
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in r.stderr
    assert "KVDI_DEEP__DEPTH='70'" in line and "less than or equal to 10" in line


def test_info_leaves_out_other_connectors_sections(tmp_path: Path) -> None:
    """With the plugin selected, no built-in connector's section is printed; with redis, only redis's is."""
    r = kvdi(tmp_path, "info", "--json", env={})
    names = {row["setting"].partition(".")[0] for row in json.loads(r.stdout)["settings"]}
    assert names.isdisjoint({"shared_storage", "cpu_offload", "redis", "multi", "p2p"})
    assert {"allocator", "transfer", "kv_connector", "deep"} <= names
    r = kvdi(
        tmp_path, "info", "--json", env={"KVDI_KV_CONNECTOR": "shared_storage", "KVDI_KV_CONNECTOR_MODULE_PATH": ""}
    )
    assert r.returncode == 0, r.stderr
    names = {row["setting"].partition(".")[0] for row in json.loads(r.stdout)["settings"]}
    assert "shared_storage" in names and names.isdisjoint({"cpu_offload", "redis", "multi", "p2p", "deep"})


def test_an_extra_config_option_reaches_the_plugins_halves() -> None:
    """``kvdi.deep.depth`` in vLLM's extra config lands in the options both halves are built with."""
    transfer = SimpleNamespace(
        kv_connector_extra_config={"kvdi.kv_connector": "deep", "kvdi.deep.depth": 4},
        kv_role="kv_both",
        engine_id="e1",
    )
    settings = load_settings(**kvdi_settings_kwargs(SimpleNamespace(kv_transfer_config=transfer)))
    container = build_kv_container(settings, registry=registry())
    for half in (container.scheduler_connector(), container.worker_connector()):
        assert half.context.options == DepthOptions(depth=4)


def test_the_variable_beats_nothing_but_init_and_a_bad_extra_config_value_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Init kwargs beat ``KVDI_DEEP__*``; a bad value from either is a ConfigError naming the option."""
    monkeypatch.setenv("KVDI_DEEP__DEPTH", "2")
    monkeypatch.setenv("KVDI_DEEP__LABEL", "env")
    settings = load_settings(kv_connector="deep", deep={"depth": 6})
    assert build_kv_container(settings, registry=registry()).options() == DepthOptions(depth=6, label="env")
    with pytest.raises(ConfigError, match=r"options of connector 'deep'.*depth.*=0.*greater than or equal to 1"):
        build_kv_container(load_settings(kv_connector="deep", deep={"depth": 0}), registry=registry()).options()


def test_another_connectors_section_is_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``KVDI_<NAME>__*`` variable of a connector that is not selected is not a setting (a typo stays an error)."""
    monkeypatch.setenv("KVDI_DEEP__DEPTH", "2")
    with pytest.raises(ConfigError, match="KVDI_DEEP__DEPTH is not a kvdi setting"):
        load_settings(kv_connector="null")


def test_a_bad_extra_config_value_names_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad ``kvdi.deep.depth`` in vLLM's transfer-config JSON is blamed on that key, with value and bound."""
    extra = {"kvdi.kv_connector": "deep", "kvdi.deep.depth": 11}
    monkeypatch.setenv(
        "KVDI_KV_TRANSFER_CONFIG", json.dumps({"kv_connector": "KvdiConnector", "kv_connector_extra_config": extra})
    )
    with pytest.raises(
        ConfigError, match=r"KVDI_KV_TRANSFER_CONFIG key kvdi\.deep\.depth=11\): .*less than or equal to 10"
    ):
        build_kv_container(load_settings(), registry=registry()).options()
