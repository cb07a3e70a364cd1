"""kvdi.integrations.vllm's vLLM-free modules import without vLLM; the package resolves KvdiConnector lazily."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvdi.integrations.vllm as package

ROOT = Path(__file__).resolve().parents[3]  # the repository: this tree's kvdi, not an installed one
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
    "fleet.stats",
    "fleet.counters",
    "fleet.ledger",
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


def test_the_package_map_lists_every_module_of_the_folder() -> None:
    """The package docstring's module map names each module and sub-package of the folder, and nothing else."""
    import re

    folder = Path(package.__file__).parent
    on_disk = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in folder.iterdir() if (p / "__init__.py").exists()
    }
    mapped = set(re.findall(r"^- :mod:`\.(\w+)`(?: / :mod:`\.(\w+)`)?", package.__doc__ or "", re.M))
    listed = {name for pair in mapped for name in pair if name}
    assert listed == on_disk, f"unmapped: {on_disk - listed}; mapped but gone: {listed - on_disk}"
