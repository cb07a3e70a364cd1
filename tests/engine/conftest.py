"""Fixtures for the reference engine tests: engine containers and a connector to load through."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvdi.containers import EngineContainer
from tests.helpers.engine import small_settings


@pytest.fixture
def store_connector(tmp_path: Path) -> dict[str, Any]:
    """Settings that select the embedded default connector (``shared_storage``) over a fresh directory."""
    return {"kv_connector": "shared_storage", "shared_storage": {"path": str(tmp_path / "store")}}


@pytest.fixture
def make_container(kvdi_env: Path, engine_containers: Callable[..., EngineContainer]) -> Callable[..., EngineContainer]:
    """``make(**settings)`` builds an engine container on a small CPU model; all are shut down after the test.

    Runs in kvdi's isolated environment (no ``KVDI_*`` env from outside, a temp working directory).
    """

    def make(**overrides: Any) -> EngineContainer:
        return engine_containers(**small_settings(**overrides))

    return make
