"""pytest plugin (entry point ``pytest11``): isolated kvdi containers for users' tests.

- ``kvdi_env``: removes every ``KVDI_*`` and ``VLLM_USE_V1`` variable and runs in a temp cwd
  (no stray ``.env``), for the test only.
- ``kvdi_overrides``: the settings the isolated containers use (temp storage dir, ``device=cpu``,
  a small block pool); override this fixture to change them.
- ``kvdi_container`` / ``kvdi_kv_container``: a fresh EngineContainer / KVTransferContainer,
  resources shut down after the test.
- ``kvdi_override``: ``kvdi_override(container, worker=..., scheduler=..., allocator=...)``;
  every override is undone when the test ends, even on failure.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

import pytest

from kvdi.containers import (
    EngineContainer,
    KvdiContainer,
    KVTransferContainer,
    build_engine_container,
    build_kv_container,
)
from kvdi.testing import override_allocator, override_connector


@pytest.fixture
def kvdi_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Clear kvdi's env vars and chdir to a temp dir; returns that dir."""
    for key in list(os.environ):
        if key.upper().startswith("KVDI_") or key.upper() == "VLLM_USE_V1":
            monkeypatch.delenv(key, raising=False)
    workdir = tmp_path / "kvdi-cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return workdir


@pytest.fixture
def kvdi_overrides(tmp_path: Path) -> dict[str, Any]:
    """Settings for isolated containers: temp store, CPU, 256 blocks, small model."""
    return {
        "shared_storage": {"path": str(tmp_path / "kv-store")},
        "allocator": {"device": "cpu", "num_blocks": 256},
    }


@pytest.fixture
def kvdi_container(kvdi_env: Path, kvdi_overrides: dict[str, Any]) -> Iterator[EngineContainer]:
    """A validated EngineContainer on isolated settings; its resources are freed afterwards."""
    container = build_engine_container(**kvdi_overrides)
    yield container
    container.shutdown_resources()


@pytest.fixture
def kvdi_kv_container(kvdi_env: Path, kvdi_overrides: dict[str, Any]) -> Iterator[KVTransferContainer]:
    """A validated KVTransferContainer on isolated settings; its resources are freed afterwards."""
    container = build_kv_container(**kvdi_overrides)
    yield container
    container.shutdown_resources()


@pytest.fixture
def kvdi_override() -> Iterator[Callable[..., None]]:
    """Override connector halves or the allocator of any container for this test only."""
    with ExitStack() as stack:

        def apply(
            container: KvdiContainer,
            *,
            scheduler: Any = None,
            worker: Any = None,
            allocator: Any = None,
        ) -> None:
            stack.enter_context(override_connector(container, scheduler=scheduler, worker=worker))
            if allocator is not None:
                if not hasattr(container, "alloc"):
                    raise TypeError("allocator overrides need an EngineContainer")
                stack.enter_context(override_allocator(cast(EngineContainer, container), allocator))

        yield apply
