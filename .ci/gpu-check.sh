#!/usr/bin/env bash
# Run kvdi's CUDA tests (pytest marker `cuda`, tests/test_cuda.py) on a machine with an NVIDIA GPU:
# the allocator on cuda, pinned staging, the cpu_offload pinned pool, a CUDA cache staged
# through the store halves, and NCCL p2p (that one needs two GPUs and is skipped with one).
#
# Creates .venv the way the Makefile does (its own install target: torch==2.13.0 first, then
# kvdi[dev]); PyPI's Linux torch wheel carries CUDA. Fails when torch sees no CUDA device, so a
# run where every test skipped is never mistaken for a pass.
# Usage: .ci/gpu-check.sh [extra pytest args]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
make --no-print-directory .venv/.kvdi-installed
PY="$ROOT/.venv/bin/python"

"$PY" - <<'PYCHECK'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"gpu-check: torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})")
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, {len(names)} GPU(s): {', '.join(names)}")
PYCHECK

exec "$PY" -m pytest -m cuda tests/test_cuda.py -p no:cacheprovider -q -rs "$@"
