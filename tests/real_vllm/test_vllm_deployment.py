"""kvdi dropped into a real deployment: the vLLM plugin, a shared ``.env``, weights swapped in place.

- The ``vllm.general_plugins`` entry point registers ``KvdiConnector`` with vLLM's connector
  factory (checked in-process and on the metadata of a real ``pip install --target`` of this tree).
- One ``vllm serve`` (multiprocess engine core, stats logging every second) runs vLLM's own
  ``MultiConnector`` with a kvdi child named only ``KvdiConnector`` (no module path), from a
  folder whose ``.env`` holds other tools' variables and kvdi's store path.
- Weights replaced under the same path: the engine on the new weights loads nothing stored for
  the old ones, then loads its own KV and answers identically.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from tests.real_vllm.serve_support import VllmServer, model_with_tokenizer, word
from tests.real_vllm.vllm_support import (
    IN_PROCESS,
    MODULE_PATH,
    expected_blocks,
    expected_saved,
    files_under,
    kv_config,
    read_stats,
    require_vllm,
    run_engine,
)

require_vllm()

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
OTHER_TOOLS = "HF_TOKEN=hf_notarealtoken\nDATABASE_URL=postgres://app:pw@db:5432/app\nOPENAI_API_KEY=sk-notreal\n"


@pytest.fixture(scope="module")
def installed_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (non-editable) ``pip install --no-deps --target`` of this tree: its metadata carries the entry points."""
    src, site = tmp_path_factory.mktemp("kvdi-src"), tmp_path_factory.mktemp("kvdi-site")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvdi", src / "kvdi", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return site


def plugin_env(site: Path) -> dict[str, str]:
    """Env for a vLLM process: this tree's code first, then the installed copy's metadata (its entry points)."""
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}


def test_register_adds_kvdi_connector_to_vllms_factory_once() -> None:
    """register() is what vLLM calls per process; twice is harmless; MultiConnector rebuilds kvdi's stats by name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvdi.integrations.vllm import KvdiConnector
    from kvdi.integrations.vllm.plugin import is_registered, register

    register()
    register()
    assert is_registered()
    assert KVConnectorFactory.get_connector_class_by_name("KvdiConnector") is KvdiConnector
    rebuilt = MultiConnector.build_kv_connector_stats({"KvdiConnector": {"shared_storage": {"saved_blocks": 3}}})
    assert rebuilt is not None
    assert rebuilt.data["KvdiConnector"].data == {"shared_storage": {"saved_blocks": 3}}


def test_the_installed_package_declares_the_vllm_plugin(installed_site: Path) -> None:
    """What vLLM's plugin loader finds in an installed kvdi: group vllm.general_plugins, name kvdi, our register()."""
    from kvdi.integrations.vllm.plugin import register

    (dist,) = [d for d in metadata.distributions(path=[str(installed_site)]) if d.metadata["Name"] == "kvdi"]
    plugins = [ep for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in plugins] == [("kvdi", "kvdi.integrations.vllm.plugin:register")]
    assert plugins[0].load() is register


@pytest.fixture(scope="module")
def multi_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, prompts: list[list[int]], installed_site: Path
) -> Iterator[tuple[VllmServer, Path, list[str]]]:
    """``vllm serve`` with MultiConnector(KvdiConnector), started in a folder with a shared ``.env``; answers prompts."""
    work = tmp_path_factory.mktemp("serve-multi")
    model = model_with_tokenizer(tiny_model, work / "model")
    app = work / "app"
    app.mkdir()
    (app / ".env").write_text(OTHER_TOOLS + f"KVDI_SHARED_STORAGE__PATH={work / 'store'}\n")
    kvdi_child = {
        "kv_connector": "KvdiConnector",  # no kv_connector_module_path: the plugin registered the name
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvdi.kv_connector": "shared_storage", "kvdi_stats_dir": str(work / "stats")},
    }
    kv = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [kvdi_child]},
    }
    env = {**plugin_env(installed_site), "VLLM_LOG_STATS_INTERVAL": "1"}
    previous = Path.cwd()
    os.chdir(app)  # vllm serve runs where the operator stands: next to the .env
    try:
        server = VllmServer(model, work / "serve-multi.log", kv, env=env)
    finally:
        os.chdir(previous)
    try:
        server.wait_ready()
        texts = [server.complete(" ".join(word(t) for t in prompt)) for prompt in prompts]
        time.sleep(3)  # past a few stats-log intervals: the front end rebuilds the children's stats by name
        yield server, work, texts
    except BaseException:
        print(server.log_tail())
        raise
    finally:
        server.stop()


def test_multiconnector_with_kvdi_serves_and_logs_stats(multi_server: tuple[VllmServer, Path, list[str]]) -> None:
    """The first requests no longer kill the server: it answers, logs kvdi's transfer stats, stays healthy."""
    server, _work, texts = multi_server
    assert all(text.split() and all(w.startswith("w") for w in text.split()) for text in texts)
    assert server.complete("w5 w6 w7", max_tokens=2).split()
    log = server.log.read_text(errors="replace")
    assert "KV Transfer metrics:" in log, server.log_tail()
    assert "is not registered" not in log and "Traceback" not in log, server.log_tail()


def test_serve_reads_kvdi_keys_of_a_shared_dotenv_and_ignores_the_rest(
    multi_server: tuple[VllmServer, Path, list[str]], prompts: list[list[int]]
) -> None:
    """HF_TOKEN and friends in .env do not stop kvdi; its KVDI_SHARED_STORAGE__PATH there is where KV lands."""
    _server, work, _texts = multi_server
    assert read_stats(work / "stats", "worker")["saved_blocks"] == expected_saved(prompts)
    assert files_under(work / "store")[0] == expected_saved(prompts)


def _swap_weights_in_place(model: Path) -> None:
    """New weights under the same path, same file names and sizes (a fine-tune's shape): every tensor negated."""
    from safetensors.torch import load_file, save_file

    for shard in sorted(model.glob("*.safetensors")):
        size = shard.stat().st_size
        tensors = {name: -tensor for name, tensor in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
        assert shard.stat().st_size == size


def test_weights_swapped_in_place_never_load_the_old_weights_kv(
    tmp_path: Path, tiny_model: Path, base_spec: dict[str, Any], prompts: list[list[int]], installed_site: Path
) -> None:
    """Engine 1 stores KV of the old weights; engine 2 on new weights at the same path loads none of it, then its own."""
    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    kv = kv_config("shared_storage", shared_storage__path=str(tmp_path / "store"))
    assert kv.pop("kv_connector_module_path") == MODULE_PATH  # selected by name through the plugin
    spec = {**base_spec, "model": str(model)}
    env = {**plugin_env(installed_site), **IN_PROCESS}

    old = run_engine(tmp_path, "old-weights", {**spec, "kv": {**kv, **_stats(kv, tmp_path / "stats-old")}}, env=env)
    assert read_stats(tmp_path / "stats-old", "worker")["saved_blocks"] == expected_saved(prompts)

    _swap_weights_in_place(model)
    new_spec = {**spec, "rounds": 2, "prefix_caching": False, "kv": {**kv, **_stats(kv, tmp_path / "stats-new")}}
    new = run_engine(tmp_path, "new-weights", new_spec, env=env)

    first, second = (r["tokens"] for r in new["rounds"])
    assert first == second  # round 2 from kvdi (its own KV) answers as round 1 computed
    assert first != old["rounds"][0]["tokens"]  # the weights really changed
    # Round 1 loaded nothing (the old weights' KV is a miss); round 2 loaded exactly its own blocks.
    assert read_stats(tmp_path / "stats-new", "worker")["loaded_blocks"] == expected_blocks(prompts)
    assert read_stats(tmp_path / "stats-new", "scheduler")["lookup_hit_blocks"] == expected_blocks(prompts)


def _stats(kv: dict[str, Any], stats_dir: Path) -> dict[str, Any]:
    return {"kv_connector_extra_config": {**kv["kv_connector_extra_config"], "kvdi_stats_dir": str(stats_dir)}}
