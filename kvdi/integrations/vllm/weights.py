"""The identity of a model's weights, which the vLLM adapter puts in the layout fingerprint instead of ``--model``.

Stored KV is only valid for the weights that computed it. Keying it by the ``--model``
string would load stale KV after new weights are copied under the same path, and would keep
two paths of the same weights apart. :func:`weights_identity` names the weights by content:

- a local folder (or the Hugging Face cache snapshot of a hub id, looked up offline): a
  BLAKE2b digest over every regular file below it that can hold weights (:func:`weight_files`:
  a weight suffix such as ``.safetensors`` or tensorizer's ``.tensors``, in sub-folders too, or
  any other file of :data:`LARGE_FILE_BYTES` or more that is no tokenizer or text file), each by
  its relative name, its size and its bytes: hashed whole up to :data:`FULL_HASH_BYTES`, sampled
  above (:func:`sample_count` samples of :data:`SAMPLE_BYTES`, more for larger files, the tail
  included), plus the metadata files (``config.json``, the shard indexes) read with a bound of
  :data:`METADATA_MAX_BYTES` (a larger one is sampled like weights). Symlinks are followed only
  to regular files inside the model folder (for a Hugging Face snapshot, inside its repository
  cache, where the blobs are); paths and modification times never count;
- an operator's ``kvdi.model_revision`` (``KVDI_MODEL_REVISION``) replaces all of that:
  the operator vouches that equal revisions mean equal weights;
- a local folder with nothing recognisable as weights is refused (:class:`~kvdi.errors.ConfigError`,
  also logged): its path says nothing about what it serves, so without ``kvdi.model_revision``
  kvdi will not share a store under it;
- a hub id that is not in the local cache: the id and vLLM's ``--revision``, logged as such.

The trade-off: hashing every byte of hundreds of GB of weights would cost minutes at every
engine start, so files above :data:`FULL_HASH_BYTES` are sampled (at most
:data:`MAX_SAMPLES` x :data:`SAMPLE_BYTES` read each, 16 MiB); weights that differ only in
bytes no sample covers (same names, same sizes) would share KV. Fine-tuned or re-quantized
weights differ everywhere, so a sample sees them; operators who patch a few tensors of large
files set ``kvdi.model_revision``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import BinaryIO

from kvdi.errors import ConfigError

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".gguf", ".pdparams", ".msgpack", ".h5", ".tensors", ".ckpt",
    ".npz", ".npy", ".onnx", ".pb", ".nemo", ".distcp", ".pkl", ".ggml",
)  # fmt: skip
METADATA_FILES = (
    "config.json", "params.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
    "quantize_config.json", "quant_config.json", "hf_quant_config.json", "adapter_config.json",
)  # fmt: skip
NOT_WEIGHTS_SUFFIXES = (".json", ".txt", ".md", ".py", ".model", ".tiktoken", ".jinja", ".yaml", ".yml", ".lock")
LARGE_FILE_BYTES = 16 << 20
FULL_HASH_BYTES = 64 << 20
METADATA_MAX_BYTES = 1 << 20
SAMPLES = 16
SAMPLE_BYTES = 4096
MAX_SAMPLES = 4096
SAMPLE_EVERY_BYTES = 16 << 20  # one more sample per this many bytes of a sampled file
REVISION_PREFIX = "revision:"
WEIGHTS_PREFIX = "weights:"
_CHUNK = 1 << 20


def weights_identity(model: str, revision: str | None = None, override: str | None = None) -> str:
    """``revision:<override>``, ``weights:<32 hex>`` of the weights' content, or ``model[@revision]`` for a hub id
    not on this machine; ConfigError for a local model with no weights kvdi recognises (set the override)."""
    if override:
        return REVISION_PREFIX + override
    location = local_weights(model, revision)
    if location is None:
        logger.warning("model %r is not on this machine: its KV is keyed by the hub id%s, not by the weights' "
                       "content; set kvdi.model_revision to say which weights", model,
                       f" and revision {revision!r}" if revision else "")  # fmt: skip
        return f"{model}@{revision}" if revision else model
    digest = weights_digest(location)
    if not digest:
        message = (
            f"model {model!r}: no weight files kvdi recognises under {str(location)!r} (suffixes "
            f"{', '.join(WEIGHT_SUFFIXES[:4])}, ...; or files of {LARGE_FILE_BYTES >> 20} MiB or more), so its KV "
            "cannot be keyed by the weights' content; set kvdi.model_revision (KVDI_MODEL_REVISION, or "
            '"kvdi.model_revision" in kv_connector_extra_config) to the weights\' version'
        )
        logger.error("%s", message)
        raise ConfigError(message)
    return WEIGHTS_PREFIX + digest


def local_weights(model: str, revision: str | None = None) -> Path | None:
    """The folder or file holding ``model``'s weights on this machine, or None (checks the HF cache, offline)."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not cached, not a repo id, offline errors: no content identity to offer
        return None


def _root_of(location: Path) -> Path:
    """Where symlinks below ``location`` may point: the folder itself, or a Hugging Face repository cache."""
    folder = location.resolve()
    return folder.parent.parent if folder.parent.name == "snapshots" else folder


def _regular(path: Path, root: Path) -> os.stat_result | None:
    """The stat of a regular file, following a symlink only when it resolves inside ``root``; else None."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        target = path.resolve()
        if not target.is_relative_to(root):
            logger.warning("weights identity: %s points outside the model folder; not followed", path)
            return None
        st = target.stat()
    return st if stat.S_ISREG(st.st_mode) else None


def weight_files(location: Path) -> list[tuple[str, Path, int, bool]]:
    """``(relative name, path, size, is_metadata)`` of every file below ``location`` that counts, in name order."""
    if location.is_file():
        return [(location.name, location, location.stat().st_size, False)]
    root = _root_of(location)
    found: list[tuple[str, Path, int, bool]] = []
    for folder, dirs, files in os.walk(location, followlinks=False):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            path = Path(folder) / name
            st = _regular(path, root)
            if st is None or name.startswith("."):
                continue
            relative = path.relative_to(location).as_posix()
            if name in METADATA_FILES:
                found.append((relative, path, st.st_size, True))
            elif name.endswith(WEIGHT_SUFFIXES) or (
                st.st_size >= LARGE_FILE_BYTES and not name.endswith(NOT_WEIGHTS_SUFFIXES) and "tokenizer" not in name
            ):
                found.append((relative, path, st.st_size, False))
    return sorted(found)


def weights_digest(location: Path) -> str:
    """32 hex digits over the weight files at ``location`` (a folder or one file); empty if it holds none."""
    hasher = hashlib.blake2b(digest_size=16)
    weights = False
    for relative, path, size, metadata in weight_files(location):
        weights = weights or not metadata
        whole = size <= (METADATA_MAX_BYTES if metadata else FULL_HASH_BYTES)
        hasher.update(f"{relative}\0{size}\0{'whole' if whole else 'sampled'}\0".encode())
        with path.open("rb") as stream:
            if whole:
                left = size  # never more than the size seen: a file growing meanwhile is not read on
                while left > 0 and (chunk := stream.read(min(_CHUNK, left))):
                    hasher.update(chunk)
                    left -= len(chunk)
            else:
                _sample(hasher, stream, size)
    return hasher.hexdigest() if weights else ""


def sample_count(size: int) -> int:
    """How many samples a file of ``size`` bytes above :data:`FULL_HASH_BYTES` gets: more for larger files."""
    return min(MAX_SAMPLES, SAMPLES + size // SAMPLE_EVERY_BYTES)


def _sample(hasher: hashlib.blake2b, stream: BinaryIO, size: int) -> None:
    count = sample_count(size)
    last = max(size - SAMPLE_BYTES, 0)
    for offset in sorted({last * i // (count - 1) for i in range(count)}):
        stream.seek(offset)
        hasher.update(stream.read(SAMPLE_BYTES))


__all__ = [
    "FULL_HASH_BYTES",
    "METADATA_MAX_BYTES",
    "REVISION_PREFIX",
    "SAMPLES",
    "SAMPLE_BYTES",
    "WEIGHTS_PREFIX",
    "local_weights",
    "sample_count",
    "weight_files",
    "weights_digest",
    "weights_identity",
]
