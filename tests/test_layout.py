"""kvdi.layout: the KV layout contract (shape, sizes, fingerprint) and the one format version."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest

import kvdi
from kvdi import layout
from kvdi.connectors.store.framing import frame_header
from kvdi.layout import FORMAT_VERSION, KVCacheSpec

FIELDS = dict(model_id="m", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def test_sizes_of_a_block() -> None:
    spec = KVCacheSpec(**FIELDS)  # type: ignore[arg-type]
    assert spec.block_shape == (2, 4, 2, 8)
    assert spec.layer_block_bytes == 256  # K and V, 4 tokens, 2 heads, 8 dims, 2 bytes
    assert spec.block_bytes == 768
    assert spec.layer_names == ("layers.0", "layers.1", "layers.2")


def test_fingerprint_changes_with_every_layout_field() -> None:
    base = KVCacheSpec(**FIELDS).fingerprint()  # type: ignore[arg-type]
    changes = {"model_id": "n", "num_layers": 4, "num_kv_heads": 1, "head_dim": 16, "block_size": 8, "dtype": "float32"}
    for key, value in changes.items():
        assert KVCacheSpec(**{**FIELDS, key: value}).fingerprint() != base, key  # type: ignore[arg-type]


def test_fingerprint_changes_with_the_format_version(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = KVCacheSpec(**FIELDS)  # type: ignore[arg-type]
    before = spec.fingerprint()
    monkeypatch.setattr(layout, "FORMAT_VERSION", FORMAT_VERSION + 1)
    assert spec.fingerprint() != before


def test_frames_carry_the_layout_format_version() -> None:
    header = frame_header(bytes(16), [b"payload"], name=bytes(16))
    assert struct.unpack_from("<H", header, 4)[0] == FORMAT_VERSION == 3


def test_the_layout_is_exported_at_the_top_and_imports_no_torch() -> None:
    assert kvdi.KVCacheSpec is KVCacheSpec
    code = "import sys, kvdi.layout; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
