"""Shared test setup. kvdi's own pytest plugin (kvdi.testing.plugin) is loaded through its
``pytest11`` entry point; ``pytester`` runs inner test sessions for the plugin's tests."""

import os as _os
from collections.abc import Callable as _Callable
from collections.abc import Iterator as _Iterator
from typing import Any as _Any

import pytest as _pytest
import torch as _torch

from kvdi.containers import EngineContainer as _EngineContainer
from kvdi.containers import build_engine_container as _build_engine_container
from kvdi.testing.redis_server import INSTALL_HINT as _REDIS_HINT
from kvdi.testing.redis_server import RedisServer as _RedisServer
from kvdi.testing.redis_server import find_redis_server as _find_redis_server

pytest_plugins = ["pytester"]


@_pytest.fixture
def engine_containers() -> _Iterator[_Callable[..., _EngineContainer]]:
    """``make(**settings)`` builds an EngineContainer; after the test each started engine is shut down
    (its background transfers end) and each container's resources are freed."""
    made: list[_EngineContainer] = []

    def make(**settings: _Any) -> _EngineContainer:
        container = _build_engine_container(**settings)
        made.append(container)
        return container

    yield make
    for container in made:
        if container.engine.initialized:
            container.engine().shutdown()
        container.shutdown_resources()


@_pytest.fixture(autouse=True)
def one_torch_thread() -> _Iterator[None]:
    """One intra-op thread: on a shared 2-core machine, OpenMP threads waiting on each other cost seconds."""
    before = _torch.get_num_threads()
    _torch.set_num_threads(1)
    yield
    _torch.set_num_threads(before)


# --- redis-server fixtures ------------------------------------------------------------------
def _require_redis_server() -> None:
    """Fail under CI (env CI set), else skip, when the redis-server binary is missing."""
    if _find_redis_server() is None:
        message = f"redis-server not found; {_REDIS_HINT}"
        if _os.environ.get("CI"):
            _pytest.fail(message)
        _pytest.skip(message)


@_pytest.fixture
def redis_server_factory() -> _Iterator[_Callable[..., _RedisServer]]:
    """``make(password=None, **kwargs)`` starts a fresh redis-server; all are stopped after the test."""
    _require_redis_server()
    started: list[_RedisServer] = []

    def make(**kwargs: object) -> _RedisServer:
        server = _RedisServer(**kwargs).start()  # type: ignore[arg-type]
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@_pytest.fixture
def redis_server(redis_server_factory: _Callable[..., _RedisServer]) -> _RedisServer:
    """A fresh redis-server on a free loopback port (no password), stopped after the test."""
    return redis_server_factory()


# --- end of redis-server fixtures ----------------------------------------------------------
