"""kvdi.integrations.vllm's vLLM-free modules import without vLLM; the package resolves KvdiConnector lazily."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvdi.integrations.vllm as package

ROOT = Path(__file__).resolve().parents[2]
VLLM_FREE = (
    "async_loads",
    "block_index",
    "bridge",
    "config",
    "groups",
    "halves",
    "hybrid",
    "layout",
    "parallel",
    "requests",
    "shared",
    "stats",
)


def test_vllm_free_modules_do_not_import_vllm() -> None:
    modules = ", ".join(f"kvdi.integrations.vllm.{m}" for m in VLLM_FREE)
    code = f"import sys, {modules}; print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert out.stdout.strip() == "[]"


def test_unknown_attribute_of_the_package_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        package.NoSuchThing  # noqa: B018
