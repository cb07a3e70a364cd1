"""The reference engine the containers inject into: model, scheduler, worker, engine.

Business code here receives its collaborators in ``__init__`` and never imports the
container. Importing this package is light; each name is imported on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLMEngine": "kvdi.engine.engine",
    "RequestOutput": "kvdi.engine.engine",
    "EngineConnectorStats": "kvdi.engine.engine",
    "BlockPoolUsage": "kvdi.engine.engine",
    "Scheduler": "kvdi.engine.scheduler",
    "Request": "kvdi.engine.scheduler",
    "Worker": "kvdi.engine.worker",
    "TransformerModel": "kvdi.engine.model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
