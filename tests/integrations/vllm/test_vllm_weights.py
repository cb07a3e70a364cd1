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
from kvdi.integrations.vllm.weights import (
    FULL_HASH_BYTES,
    METADATA_MAX_BYTES,
    SAMPLE_BYTES,
    SAMPLES,
    sample_count,
    weights_digest,
    weights_identity,
)


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


def counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every ``read`` of a file opened through ``Path.open`` from now on, by its byte count."""
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
    return read


def sparse(path: Path, size: int, at: int | None = None, byte: bytes = b"\1") -> Path:
    """A sparse file of ``size`` zero bytes (no disk used), with ``byte`` written at ``at``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        out.truncate(size)
        if at is not None:
            out.seek(at)
            out.write(byte)
    return path


def test_the_digest_reads_a_bounded_sample_of_each_large_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However large the shards, at most sample_count(size) * SAMPLE_BYTES bytes of each are read (more samples
    for larger files); the config is read whole (it is small)."""
    folder = tmp_path / "big"
    sizes = (200 << 20, 2 << 30)
    for i, size in enumerate(sizes):
        sparse(folder / f"model-0000{i}.safetensors", size)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    read = counting_reads(monkeypatch)
    assert weights_digest(folder)
    assert sample_count(sizes[1]) > sample_count(sizes[0]) > SAMPLES
    assert sum(read) <= sum(sample_count(s) for s in sizes) * SAMPLE_BYTES + len('{"model_type": "llama"}')


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


# -- issue 28, item 5: never a silent fallback to the path ----------------------------------------


@pytest.mark.parametrize("layout", ["tensorizer", "sub-folder"])
def test_weights_the_old_suffix_list_missed_are_found_and_swapping_them_changes_the_identity(
    tmp_path: Path, layout: str
) -> None:
    """tensorizer's ``model.tensors`` at the top, or safetensors in a sub-folder: a content identity (never the
    path), and new bytes copied in place change it."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    shard = folder / ("model.tensors" if layout == "tensorizer" else "weights/model-00001.safetensors")
    shard.parent.mkdir(exist_ok=True)
    shard.write_bytes(os.urandom(1 << 20))
    before = weights_identity(str(folder))
    assert before.startswith("weights:") and str(folder) not in before
    shard.write_bytes(os.urandom(1 << 20))
    assert weights_identity(str(folder)) != before


def test_a_folder_with_no_weights_kvdi_recognises_requires_model_revision(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only a config and a tokenizer (the weights elsewhere): refused with a message naming kvdi.model_revision
    (and logged); with the revision set the operator's word is the identity."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="kvdi.model_revision") as info:
        weights_identity(str(folder))
    assert "KVDI_MODEL_REVISION" in str(info.value)
    assert any("no weight files" in r.getMessage() for r in caplog.records)
    assert weights_identity(str(folder), override="v3") == "revision:v3"


def test_two_64_mib_files_that_differ_only_between_the_old_samples_differ(tmp_path: Path) -> None:
    """Files up to FULL_HASH_BYTES are hashed whole: one byte changed where 16 evenly spaced samples never
    look gives another identity."""
    size = FULL_HASH_BYTES
    between = (size - SAMPLE_BYTES) // 15 // 2  # halfway between the first and the second old sample
    a = sparse(tmp_path / "a" / "model.safetensors", size)
    b = sparse(tmp_path / "b" / "model.safetensors", size, at=between)
    assert weights_digest(a.parent) != weights_digest(b.parent)


def test_a_symlink_out_of_the_model_folder_is_not_followed(tmp_path: Path) -> None:
    """Weights that are only a symlink to a file outside the folder count as nothing (refused); a symlink to a
    file inside the folder is hashed as that file."""
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(os.urandom(4096))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(outside)
    with pytest.raises(ConfigError):
        weights_identity(str(folder))
    (folder / "model.safetensors").unlink()
    (folder / "real.bin").write_bytes(os.urandom(4096))
    (folder / "model.safetensors").symlink_to(folder / "real.bin")
    assert weights_identity(str(folder)).startswith("weights:")


def test_a_hugging_face_snapshot_follows_its_links_into_the_repository_blobs(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_bytes(os.urandom(4096))
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to("../../blobs/abc123")
    assert weights_identity(str(snapshot)).startswith("weights:")


def test_a_huge_config_is_read_with_a_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 300 MB config.json is sampled like a weight file, never read whole."""
    folder = tmp_path / "model"
    (folder).mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    sparse(folder / "config.json", 300 * 10**6)
    read = counting_reads(monkeypatch)
    assert weights_identity(str(folder)).startswith("weights:")
    assert sum(read) <= sample_count(300 * 10**6) * SAMPLE_BYTES + 4096
    assert METADATA_MAX_BYTES < 300 * 10**6
