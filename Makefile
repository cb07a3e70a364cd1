# The two commands of the README: `make demo` (the main job) and `make test` (everything).
# Each creates .venv on first use, installing torch==2.13.0 (CPU wheel) before kvdi so pip
# never resolves kvdi's `torch>=2.4` to a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvdi-installed

.PHONY: demo test lint test-unit test-vllm test-gpu system-deps bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvdi demo

# mypy twice: over kvdi/ in .venv (vLLM seen as Any), and over the vLLM adapter in .venv-vllm against
# vLLM's own types (.ci/vllm-mypy.sh builds or reuses that venv and adds mypy to it).
lint: $(STAMP)
	$(BIN)/ruff check kvdi tests containers benchmarks
	$(BIN)/ruff format --check kvdi tests containers benchmarks
	$(BIN)/mypy
	bash .ci/vllm-mypy.sh

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q --ignore=tests/real_vllm -n 2 --dist loadfile

test-vllm:
	bash .ci/vllm-tests.sh

# Needs an NVIDIA GPU: the `cuda` tests (allocator, pinned staging, device staging, NCCL p2p).
test-gpu:
	bash .ci/gpu-check.sh

# redis-server is a real server the tests start on loopback (redis-cli creates the test clusters);
# install it when we can (root + apt).
system-deps:
	@command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then apt-get update -q && apt-get install -y -q redis-server; \
	  else echo "redis-server or redis-cli is missing: install them (e.g. sudo apt-get install -y redis-server)"; exit 1; fi; }

test: system-deps lint test-unit test-vllm

bench: $(STAMP)
	$(BIN)/kvdi bench

clean:
	rm -rf $(VENV) .venv-vllm .mypy_cache .ruff_cache .pytest_cache
