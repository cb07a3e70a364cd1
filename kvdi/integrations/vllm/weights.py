"""The identity of a model's weights, which the vLLM adapter puts in the layout fingerprint instead of ``--model``.

Stored KV is only valid for the weights that computed it. Keying it by the ``--model``
string would load stale KV after new weights are copied under the same path, and would keep
two paths of the same weights apart. :func:`weights_identity` names the weights by content:

- a local folder (or the Hugging Face cache snapshot of a hub id, looked up offline): a
  BLAKE2b digest over the weight files' names and sizes, :data:`SAMPLES` evenly spaced
  :data:`SAMPLE_BYTES`-byte samples of each file's bytes (the tail included), and the whole
  ``config.json`` and safetensors index; reads at most ``SAMPLES * SAMPLE_BYTES`` bytes per
  file however large the weights are, and never looks at paths or modification times;
- an operator's ``kvdi.model_revision`` (``KVDI_MODEL_REVISION``) replaces all of that:
  the operator vouches that equal revisions mean equal weights;
- a hub id that is not in the local cache: the id and vLLM's ``--revision``, as before.

The trade-off: sampling, not hashing every byte, keeps engine start fast on
hundreds of GB of weights; weights that differ only in bytes no sample covers (and have the
same names and sizes) would share KV. Fine-tuned or re-quantized weights differ everywhere,
so a sample sees them; operators who patch a few tensors set ``kvdi.model_revision``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".pdparams", ".msgpack", ".h5")
WHOLE_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
SAMPLES = 16
SAMPLE_BYTES = 4096
REVISION_PREFIX = "revision:"
WEIGHTS_PREFIX = "weights:"


def weights_identity(model: str, revision: str | None = None, override: str | None = None) -> str:
    """``revision:<override>``, ``weights:<32 hex>`` of the weights' content, or ``model[@revision]`` as a fallback."""
    if override:
        return REVISION_PREFIX + override
    location = local_weights(model, revision)
    if location is None:
        return f"{model}@{revision}" if revision else model
    digest = weights_digest(location)
    return WEIGHTS_PREFIX + digest if digest else (f"{model}@{revision}" if revision else model)


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


def weights_digest(location: Path) -> str:
    """32 hex digits over the weight files at ``location`` (a folder or one file); empty if it holds none."""
    files = [location] if location.is_file() else sorted(p for p in location.iterdir() if p.is_file())
    hasher = hashlib.blake2b(digest_size=16)
    found = False
    for path in files:
        if path.name in WHOLE_FILES:
            hasher.update(f"{path.name}\0whole\0".encode())
            hasher.update(path.read_bytes())
        elif path.suffix in WEIGHT_SUFFIXES or location.is_file():
            found = True
            _sample_file(hasher, path)
    return hasher.hexdigest() if found else ""


def _sample_file(hasher: hashlib.blake2b, path: Path) -> None:
    size = path.stat().st_size
    hasher.update(f"{path.name}\0{size}\0".encode())
    last = max(size - SAMPLE_BYTES, 0)
    offsets = sorted({last * i // (SAMPLES - 1) for i in range(SAMPLES)})
    with path.open("rb") as stream:
        for offset in offsets:
            stream.seek(offset)
            hasher.update(stream.read(SAMPLE_BYTES))


__all__ = [
    "REVISION_PREFIX",
    "SAMPLES",
    "SAMPLE_BYTES",
    "WEIGHTS_PREFIX",
    "local_weights",
    "weights_digest",
    "weights_identity",
]
