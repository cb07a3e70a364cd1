"""Fixtures for the vLLM integration tests: a tiny random Llama, prompts, and a no-connector baseline.

Nothing here imports vLLM; each test module calls :func:`vllm_support.require_vllm` first,
which skips it where vLLM is not importable (kvdi's own venv) and fails it instead under
``REQUIRE_VLLM_TESTS=1`` (set by ``.ci/vllm-tests.sh``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (hidden 128, 4 heads, 2 KV heads, head_dim 32) saved as safetensors."""
    from tests.real_vllm.vllm_support import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    from tests.real_vllm.vllm_support import PROMPT_LENGTHS, make_prompts

    return [make_prompts(1, n, seed=i)[0] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="session")
def base_spec(tiny_model: Path, prompts: list[list[int]]) -> dict[str, Any]:
    from tests.real_vllm.vllm_support import BLOCK_SIZE

    return {"model": str(tiny_model), "prompts": prompts, "rounds": 1, "max_tokens": 8, "block_size": BLOCK_SIZE}


@pytest.fixture(scope="session")
def baseline_tokens(tmp_path_factory: pytest.TempPathFactory, base_spec: dict[str, Any]) -> list[list[int]]:
    """Greedy tokens of the prompts with no KV connector at all."""
    from tests.real_vllm.vllm_support import IN_PROCESS, run_engine

    result = run_engine(tmp_path_factory.mktemp("baseline"), "baseline", base_spec, env=IN_PROCESS)
    tokens: list[list[int]] = result["rounds"][0]["tokens"]
    assert all(len(t) == 8 for t in tokens)
    return tokens
