"""Python calls counted with ``sys.setprofile``: a deterministic measure of per-step cost (no timing)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def calls(fn: Callable[..., Any], *args: Any) -> tuple[int, Any]:
    """Python function calls made by ``fn(*args)`` (itself included), and its result."""
    count = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        count += event == "call"

    sys.setprofile(profile)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return count, result
