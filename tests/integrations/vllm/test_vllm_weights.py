"""The weights' identity in the vLLM adapter's layout (kvdi.integrations.vllm.weights and config.model_identity)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvdi.errors import ConfigError
from kvdi.integrations.vllm.config import model_identity
from kvdi.integrations.vllm.weights import SAMPLE_BYTES, SAMPLES, weights_digest, weights_identity


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    """A model folder: config, two safetensors shards of 1 MiB each, a tokenizer file."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text("{}")
    for i in range(2):
        (folder / f"model-0000{i}.safetensors").write_bytes(os.urandom(1 << 20))
    return folder


def _vllm_config(model: Path | str, extra: dict[str, Any] | None = None) -> Any:
    transfer = (
        None if extra is None else SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_both", engine_id="e")
    )
    return SimpleNamespace(model_config=SimpleNamespace(model=str(model), revision=None), kv_transfer_config=transfer)


def test_the_same_weights_under_two_paths_have_one_identity(weights: Path, tmp_path: Path) -> None:
    """A copy (new path, new mtimes) is the same weights: its KV is shared."""
    copy = shutil.copytree(weights, tmp_path / "elsewhere" / "other-name")
    assert weights_identity(str(weights)) == weights_identity(str(copy))
    assert weights_identity(str(weights)).startswith("weights:")


def test_new_weights_copied_in_place_change_the_identity(weights: Path) -> None:
    """Same path, same file names and sizes, new bytes: a new identity, so stored KV is a miss."""
    before = weights_identity(str(weights))
    shard = weights / "model-00001.safetensors"
    shard.write_bytes(os.urandom(shard.stat().st_size))
    assert weights_identity(str(weights)) != before


def test_files_that_are_not_weights_do_not_change_the_identity(weights: Path) -> None:
    """A new tokenizer or README does not invalidate the KV of the same weights."""
    before = weights_identity(str(weights))
    (weights / "tokenizer.json").write_text('{"changed": true}')
    (weights / "README.md").write_text("notes")
    assert weights_identity(str(weights)) == before


def test_a_changed_config_changes_the_identity(weights: Path) -> None:
    before = weights_identity(str(weights))
    (weights / "config.json").write_text('{"model_type": "llama", "rope_theta": 1.0}')
    assert weights_identity(str(weights)) != before


def test_the_digest_reads_a_bounded_sample_of_each_file(weights: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However large the shards, at most SAMPLES * SAMPLE_BYTES bytes of each are read."""
    read: list[int] = []
    real_open = Path.open

    def counting_open(self: Path, *args: Any, **kwargs: Any) -> Any:
        stream = real_open(self, *args, **kwargs)
        real_read = stream.read

        def counted(n: int = -1) -> bytes:
            data: bytes = real_read(n)
            read.append(len(data))
            return data

        stream.read = counted
        return stream

    monkeypatch.setattr(Path, "open", counting_open)
    assert weights_digest(weights)
    assert sum(read) <= 2 * SAMPLES * SAMPLE_BYTES + len((weights / "config.json").read_bytes())


def test_a_hub_id_that_is_not_local_keeps_its_name_and_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert weights_identity("no-such-org/no-such-model") == "no-such-org/no-such-model"
    assert weights_identity("no-such-org/no-such-model", "abc123") == "no-such-org/no-such-model@abc123"


def test_model_revision_in_extra_config_replaces_the_digest(weights: Path, kvdi_env: Path) -> None:
    """``kvdi.model_revision`` is the operator's word for the weights' identity."""
    assert model_identity(_vllm_config(weights, {"kvdi.model_revision": "llama@2024-06-01"})) == (
        "revision:llama@2024-06-01"
    )
    assert model_identity(_vllm_config(weights, {})) == weights_identity(str(weights))
    assert model_identity(_vllm_config(weights)) == weights_identity(str(weights))


def test_model_revision_from_env_and_its_bounds(weights: Path, kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_MODEL_REVISION", "v7")
    assert model_identity(_vllm_config(weights, {})) == "revision:v7"
    with pytest.raises(ConfigError, match="model_revision"):
        model_identity(_vllm_config(weights, {"kvdi.model_revision": "x" * 300}))
