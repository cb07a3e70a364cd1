"""Dotted paths of nested settings mappings, and how deep a value nests; both without recursion.

:func:`flatten` is the one flattening of settings data in kvdi (provenance, ``kvdi info``, the
vLLM adapter's ``kvdi.*`` extra-config keys); it never walks into ``kv_connector_extra_config``,
which is one opaque value. :func:`nesting_depth` lets parsers refuse data nested deeper than
:data:`MAX_NESTING` before anything recursive (``repr``, validation, masking) touches it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OPAQUE_KEYS = frozenset({"kv_connector_extra_config"})
MAX_NESTING = 32


def flatten(data: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``[(dotted path, leaf value), ...]`` in mapping order; empty mappings and opaque keys are leaves."""
    out: list[tuple[str, Any]] = []
    stack: list[tuple[str, Any]] = [(f"{prefix}{k}", v) for k, v in reversed(list(data.items()))]
    while stack:
        path, value = stack.pop()
        key = path.rpartition(".")[2]
        if isinstance(value, Mapping) and value and key not in OPAQUE_KEYS:
            stack.extend((f"{path}.{k}", v) for k, v in reversed(list(value.items())))
        else:
            out.append((path, value))
    return out


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """Levels of mappings/lists/tuples in ``value`` (a scalar is 0), counted up to ``limit + 1`` at most."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


__all__ = ["MAX_NESTING", "OPAQUE_KEYS", "flatten", "nesting_depth"]
