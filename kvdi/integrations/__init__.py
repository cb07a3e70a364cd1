"""Adapters that run kvdi's connectors inside other engines.

Each adapter lives in its own module and imports its engine only there, so
``import kvdi.integrations`` never imports vLLM: use
``kv_connector_module_path="kvdi.integrations.vllm"`` to load the vLLM one.
"""

from __future__ import annotations

__all__: list[str] = []
