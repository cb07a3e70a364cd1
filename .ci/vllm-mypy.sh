#!/usr/bin/env bash
# `mypy --strict` over the vLLM adapter (kvdi/integrations/vllm) against vLLM's own types: run in
# .venv-vllm, where vLLM is installed (the dev venv's mypy sees vLLM as Any). Part of `make lint`.
# Builds or reuses .venv-vllm through .ci/vllm-venv.sh, adding mypy there on first use.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash "$ROOT/.ci/vllm-venv.sh" --mypy
# pyproject.toml's [tool.mypy] (strict, the pydantic plugin) applies; a cache of its own: another interpreter.
"$ROOT/.venv-vllm/bin/python" -m mypy --strict --cache-dir "$ROOT/.mypy_cache/vllm-venv" kvdi/integrations/vllm
