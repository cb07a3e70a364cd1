#!/usr/bin/env bash
# kvdi's CUDA tests (pytest marker `cuda`, tests/test_cuda.py) on a machine with an NVIDIA GPU, offline.
#
#   .ci/gpu-check.sh --wheels      on a machine with network access: put kvdi's own wheel and the wheels of
#                                  its dependencies except torch into .ci/wheels/ ($KVDI_WHEELS), built for
#                                  the GPU machine's Python ($KVDI_GPU_PYVER, default 3.12, CPython,
#                                  manylinux x86_64), whatever this machine runs; carry that folder along
#   .ci/gpu-check.sh [pytest args] on the GPU machine, no network needed (pip never leaves .ci/wheels):
#     1. picks a Python whose installed torch sees CUDA ($KVDI_GPU_PYTHON, .venv, python3): never
#        downloads torch;
#     2. makes .venv-gpu on top of it (the installed torch stays, seen through a .pth file), installs
#        the dependencies it lacks from .ci/wheels and kvdi's own wheel (--no-deps), so kvdi's pytest
#        plugin (the `kvdi_env` fixtures, entry point pytest11) loads; the tests import kvdi from this
#        tree (PYTHONPATH);
#     3. runs the CUDA tests within $KVDI_GPU_CHECK_TIMEOUT_S (default 270: the whole check stays under
#        5 minutes), each test within $KVDI_GPU_TEST_TIMEOUT_S (default 90; tests/test_cuda.py fails a
#        test that runs longer), then .ci/gpu_skips.py reads the junit report: it fails on any skip
#        except the NCCL tests on a machine with one GPU, prints what was not tested and the figures
#        the tests recorded, never gating: the device rows, GB/s against one raw pinned copy_ each way of
#        CacheIO's batched chunk copies and of a 1 GiB cpu_offload save and load through the store worker
#        into and out of the page-locked pool (blocks go straight between its slots and the device)
#        (test_cpu_offload_moves_a_gib_against_raw_pinned_copies_a_gbps_line; target 0.8x).
#   .ci/gpu-check.sh --dry-run     on any machine (no GPU needed): steps 1-2 with .venv's Python, the
#                                  same pytest run and the same verdict; without a GPU every CUDA test
#                                  is skipped, so the verdict must be FAILED (exit 1): the accounting works.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS="${KVDI_WHEELS:-$ROOT/.ci/wheels}"
PYVER="${KVDI_GPU_PYVER:-3.12}"
DEPS=(dependency-injector pydantic pydantic-settings numpy xxhash rich pytest hypothesis redis safetensors)
LIMIT_S="${KVDI_GPU_CHECK_TIMEOUT_S:-270}"
export KVDI_GPU_TEST_TIMEOUT_S="${KVDI_GPU_TEST_TIMEOUT_S:-90}"

if [[ "${1:-}" == "--wheels" ]]; then
    PIP_PY="${KVDI_WHEELS_PYTHON:-}"
    for candidate in "$PIP_PY" python3 "$ROOT/.venv/bin/python"; do
        [[ -n "$candidate" ]] && "$candidate" -m pip --version >/dev/null 2>&1 && { PIP_PY="$candidate"; break; }
    done
    mkdir -p "$WHEELS"
    "$PIP_PY" -m pip wheel -q --no-deps --wheel-dir "$WHEELS" "$ROOT"  # pure Python: any platform
    # --platform: manylinux wheels for the GPU machine; pure-Python (none-any) wheels match any platform
    "$PIP_PY" -m pip download -q --dest "$WHEELS" --only-binary=:all: --implementation cp \
        --python-version "$PYVER" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 "${DEPS[@]}"
    echo "gpu-check: $(find "$WHEELS" -name '*.whl' | wc -l) wheels for CPython $PYVER manylinux x86_64 in $WHEELS" \
        "($(du -sh "$WHEELS" | cut -f1)); carry this folder to the GPU machine"
    exit 0
fi
DRY_RUN=0
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY_RUN=1
    shift
fi
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1  # offline: pip only ever reads .ci/wheels

# 1. a Python whose torch sees a GPU (--dry-run: .venv's, with or without one)
BASE=""
if [[ "$DRY_RUN" == 1 ]]; then
    BASE="$ROOT/.venv/bin/python"
else
    for candidate in "${KVDI_GPU_PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
        [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
            BASE="$candidate"
            break
        fi
    done
fi
if [[ -z "$BASE" ]]; then
    echo "gpu-check: no Python here has a torch that sees a CUDA device (set KVDI_GPU_PYTHON)" >&2
    exit 1
fi

# 2. .venv-gpu: sees the base's packages (torch) through a .pth file (a venv's --system-site-packages would
#    skip them when the base is a venv itself), plus the dependencies it lacks and kvdi itself (its pytest plugin)
VENV="${KVDI_GPU_VENV:-$ROOT/.venv-gpu}"
PY="$VENV/bin/python"
NEEDS="import torch, pydantic_settings, dependency_injector, numpy, xxhash, rich, pytest, hypothesis"
if [[ ! -x "$PY" ]]; then
    "$BASE" -m venv "$VENV" 2>/dev/null || { rm -rf "$VENV"; "$BASE" -m venv --without-pip "$VENV"; }  # no ensurepip
    "$BASE" -c "import site, sysconfig as s; p = s.get_paths(); print(*dict.fromkeys([*site.getsitepackages(), \
p['purelib'], p['platlib']]), sep='\n')" >"$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/gpu-check-base.pth"
fi
if ! "$PY" -c "$NEEDS" >/dev/null 2>&1 || ! compgen -G "$VENV/lib/python*/site-packages/kvdi-*.dist-info" >/dev/null; then
    if ! compgen -G "$WHEELS/kvdi-*.whl" >/dev/null; then
        echo "gpu-check: $VENV lacks kvdi or its dependencies and $WHEELS has no kvdi wheel: run" \
            ".ci/gpu-check.sh --wheels on a machine with network access and carry .ci/wheels along" >&2
        exit 1
    fi
    PIP=("$PY" -m pip)  # the venv's pip, else the base's pip aimed at the venv (pip >= 22.3)
    "$PY" -m pip --version >/dev/null 2>&1 || PIP=("$BASE" -m pip --python "$PY")
    "$PY" -c "$NEEDS" >/dev/null 2>&1 || "${PIP[@]}" install -q --find-links "$WHEELS" "${DEPS[@]}"
    "${PIP[@]}" install -q --no-deps --force-reinstall "$(ls -t "$WHEELS"/kvdi-*.whl | head -1)"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
GPUS="$("$PY" - <<'PYCHECK'
import sys
from importlib.metadata import entry_points

import torch

import kvdi

names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
plugin = [p.value for p in entry_points(group="pytest11") if p.name == "kvdi"]
print(f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, {len(names)} GPU(s): {', '.join(names)}",
      file=sys.stderr)
print(f"gpu-check: kvdi from {kvdi.__file__}, pytest plugin {plugin}", file=sys.stderr)
print(len(names))
PYCHECK
)"

# 3. the tests, then the verdict (a skip fails the run unless it is an NCCL test on a one-GPU machine)
REPORT="$(mktemp -d)/junit.xml"
STATUS=0
timeout "$LIMIT_S" "$PY" -m pytest -m cuda tests/test_cuda.py -p no:cacheprovider -q -rs --junitxml="$REPORT" \
    -o junit_family=xunit1 "$@" || STATUS=$?
"$PY" "$ROOT/.ci/gpu_skips.py" "$REPORT" "$STATUS" "$GPUS"
