"""Application containers under containers/: runnable scripts that compose kvdi's EngineContainer."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "containers" / "prefill_decode_pair.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("prefill_decode_pair", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def small_env(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key, value in {"NUM_LAYERS": "2", "HIDDEN_SIZE": "64", "INTERMEDIATE_SIZE": "128", "VOCAB_SIZE": "256"}.items():
        monkeypatch.setenv(f"KVDI_MODEL__{key}", value)
    monkeypatch.setenv("KVDI_ALLOCATOR__DEVICE", "cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # subprocesses: no OpenMP spinning on a shared machine
    return kvdi_env


def test_prefill_decode_pair_runs_as_a_script(small_env: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "match: yes" in done.stdout


def test_pair_builds_a_producer_and_a_consumer_on_one_store(small_env: Path, tmp_path: Path) -> None:
    app = load_script().PrefillDecodePair()
    app.config.from_dict({"store_dir": str(tmp_path), "num_blocks": 32})
    prefill, decode = app.prefill.settings(), app.decode.settings()
    assert (prefill.kv_role, decode.kv_role) == ("kv_producer", "kv_consumer")
    assert prefill.shared_storage.path == decode.shared_storage.path == tmp_path


def test_pair_shutdown_frees_both_kv_caches(small_env: Path, tmp_path: Path) -> None:
    app = load_script().PrefillDecodePair()
    app.config.from_dict({"store_dir": str(tmp_path), "num_blocks": 32})
    allocators = [app.prefill.alloc.allocator(), app.decode.alloc.allocator()]
    assert all(a.kv_caches for a in allocators)
    app.shutdown_resources()
    assert not any(a.kv_caches for a in allocators)


def test_decode_engine_loads_what_the_prefill_engine_saved(small_env: Path, tmp_path: Path) -> None:
    assert load_script().run(str(tmp_path), prompts=1, prompt_len=40, new_tokens=2) == 0
