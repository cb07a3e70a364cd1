"""Small-model settings and builders shared by the engine tests."""

from __future__ import annotations

from typing import Any

from kvdi.allocator import AllocationPlan
from kvdi.engine.model import TransformerModel
from kvdi.layout import KVCacheSpec
from kvdi.registry import BUILTIN_SPECS, ConnectorRegistry, ConnectorSpec
from kvdi.settings import ModelSettings

SMALL_MODEL: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_model_len": 512,
}
BLOCK_SIZE = 4


def small_settings(**overrides: Any) -> dict[str, Any]:
    """Keyword settings for a small CPU engine; ``overrides`` win (nested dicts replace whole sections)."""
    base: dict[str, Any] = {
        "allocator": {"device": "cpu", "block_size": BLOCK_SIZE, "num_blocks": 64},
        "model": SMALL_MODEL,
        "kv_connector": "null",
    }
    return {**base, **overrides}


def make_model(num_blocks: int = 16, **model: Any) -> TransformerModel:
    settings = ModelSettings(**{**SMALL_MODEL, **model})
    layout = KVCacheSpec("t", settings.num_layers, settings.num_kv_heads, settings.head_dim, BLOCK_SIZE, "float32")
    plan = AllocationPlan("cpu", num_blocks, layout.block_bytes, num_blocks * layout.block_bytes, 0, 0, "test")
    return TransformerModel(settings, layout, plan)


def registry_with(*extra: ConnectorSpec) -> ConnectorRegistry:
    """The built-in connectors plus ``extra``, without entry points."""
    return ConnectorRegistry(specs=(*BUILTIN_SPECS, *extra), entry_points=False)
