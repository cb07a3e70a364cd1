"""Fixtures for the reference engine tests: engine containers and a connector to load through."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdi.containers import EngineContainer, build_engine_container
from tests.helpers.engine import small_settings


@pytest.fixture
def store_connector(tmp_path: Path) -> dict[str, Any]:
    """Settings that select the embedded default connector (``shared_storage``) over a fresh directory."""
    return {"kv_connector": "shared_storage", "shared_storage": {"path": str(tmp_path / "store")}}


@pytest.fixture
def make_container(kvdi_env: Path) -> Iterator[Callable[..., EngineContainer]]:
    """``make(**settings)`` builds an engine container on a small CPU model; all are shut down after the test.

    Runs in kvdi's isolated environment (no ``KVDI_*`` env from outside, a temp working directory).
    """
    built: list[EngineContainer] = []

    def make(**overrides: Any) -> EngineContainer:
        container = build_engine_container(**small_settings(**overrides))
        built.append(container)
        return container

    yield make
    for container in built:
        container.shutdown_resources()
