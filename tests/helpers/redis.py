"""The one check the Redis tests share: redis-server and redis-cli are here (fail under CI, else skip)."""

from __future__ import annotations

import os
import shutil

import pytest

from kvdi.testing.redis_server import INSTALL_HINT, find_redis_server


def require_redis_tools() -> None:
    """Fail under CI (env ``CI`` set), else skip, when redis-server or redis-cli (clusters) is missing."""
    if find_redis_server() is None or shutil.which("redis-cli") is None:
        message = f"redis-server / redis-cli not found; {INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
