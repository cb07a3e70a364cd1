"""vLLM's KV cache groups as kvdi plans them: kinds, per-group layouts, which blocks a hit loads and a prompt stores.

vLLM's hybrid KV cache manager (HMA) gives each kind of layer its own KV cache group with its
own block table; all groups overlay the same memory, so a block id means a different block in
each group. kvdi stores a group's block under keys and frames of the group's own layout
(:func:`group_layout`: the group's kind, window, layers and block size are in the fingerprint),
so a block never loads into another group or another model shape.

Per group, as vLLM computes its own prefix-cache hits (``single_type_kv_cache_manager.py``):

- ``full`` attention needs every block of the prefix;
- ``sliding`` window needs only the ``cdiv(window - 1, block_size)`` blocks before the hit
  boundary; kvdi stores only the blocks inside the window of the boundaries a prompt can be
  offered at, and loads only those;
- ``mamba`` (and linear attention) needs one state: the block ending at the boundary (vLLM
  keeps states at block boundaries only with prefix caching on, ``mamba_cache_mode="align"``;
  other modes are refused).

:func:`best_boundary` is the hit offered to vLLM: the longest prefix every group can serve.
vLLM's config arrives as attribute bags (typed ``Any``); this module never imports vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvdi.errors import ConfigError
from kvdi.layout import KVCacheSpec

KINDS = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding", "MambaSpec": "mamba"}
"""vLLM's KV cache spec classes kvdi stores, by the kind kvdi plans them as."""


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: its kind, its layers (vLLM's names, forward order), block size and window.

    ``window_blocks`` is what a hit boundary needs of a sliding group (0 for other kinds).
    """

    index: int
    kind: str
    layer_names: tuple[str, ...]
    block_size: int
    window: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    page_bytes: int = 0

    @property
    def window_blocks(self) -> int:
        return -(-(self.window - 1) // self.block_size) if self.kind == "sliding" else 0

    def tag(self) -> str:
        """The group's part of its layout: kind, window, block size and layers."""
        return f"g{self.index}:{self.kind}:w{self.window}:bs{self.block_size}:{','.join(self.layer_names)}"

    def to_load(self, first: int, boundary: int) -> range:
        """Block indices to load for a hit ending at block ``boundary`` when blocks below ``first`` are local."""
        if self.kind == "sliding":
            return range(max(first, boundary - self.window_blocks), boundary)
        if self.kind == "mamba":
            return range(max(first, boundary - 1), boundary)
        return range(first, boundary)

    def to_save(self, start: int, end: int, prompt_tokens: int) -> list[int]:
        """Of the newly computed blocks ``[start, end)``, those to store for a prompt of ``prompt_tokens``.

        Full attention: all. Sliding window and mamba: only what the hit boundaries this prompt
        can serve need (the loadable boundary ``(prompt_tokens - 1) // block_size`` and, for a
        longer prompt sharing this one, the last full block ``prompt_tokens // block_size``).
        """
        if self.kind == "full":
            return list(range(start, end))
        loadable, full = (prompt_tokens - 1) // self.block_size, prompt_tokens // self.block_size
        if self.kind == "sliding":
            keep = range(max(0, loadable - self.window_blocks), full)
            return [i for i in range(start, end) if i in keep]
        return [i for i in range(start, end) if i + 1 in (loadable, full) and i >= 0]


def groups_from_vllm(kv_cache_config: Any) -> list[GroupSpec]:
    """kvdi's :class:`GroupSpec` of each group in vLLM's ``KVCacheConfig`` (ConfigError for unknown kinds)."""
    groups: list[GroupSpec] = []
    for i, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        kind = KINDS.get(type(spec).__name__)
        if kind is None:
            raise ConfigError(
                f"KvdiConnector cannot store KV cache group {i} of kind {type(spec).__name__}; supported: "
                f"{', '.join(KINDS)}; run vLLM with --disable-hybrid-kv-cache-manager or without kvdi"
            )
        if kind == "mamba" and getattr(spec, "mamba_cache_mode", "none") != "align":
            raise ConfigError(
                f"KvdiConnector stores a Mamba / linear-attention state per block boundary, which vLLM keeps only "
                f"with mamba_cache_mode='align'; KV cache group {i} has "
                f"{getattr(spec, 'mamba_cache_mode', None)!r}: enable prefix caching (--enable-prefix-caching)"
            )
        groups.append(
            GroupSpec(
                index=i,
                kind=kind,
                layer_names=tuple(group.layer_names),
                block_size=int(spec.block_size),
                window=int(getattr(spec, "sliding_window", 0) or 0) if kind == "sliding" else 0,
                num_kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0),
                head_dim=int(getattr(spec, "head_size", 0) or 0),
                page_bytes=int(spec.page_size_bytes) if kind == "mamba" else 0,
            )
        )
    return groups


def group_layout(base: KVCacheSpec, group: GroupSpec) -> KVCacheSpec:
    """The layout of one group's stored blocks: ``base`` narrowed to the group's layers, heads and block size."""
    return replace(
        base,
        num_layers=len(group.layer_names),
        num_kv_heads=group.num_kv_heads or base.num_kv_heads,
        head_dim=group.head_dim or base.head_dim,
        block_size=group.block_size,
        group=group.tag(),
        page_bytes=group.page_bytes,
    )


def hit_unit(groups: Sequence[GroupSpec]) -> int:
    """Tokens a hit boundary is a multiple of: every group's block size divides it."""
    return math.lcm(*(g.block_size for g in groups))


def best_boundary(
    groups: Sequence[GroupSpec],
    keys: Sequence[Sequence[bytes]],
    count_prefix: Callable[[int, Sequence[bytes]], int],
    computed: int,
    limit: int,
) -> int:
    """The longest hit in tokens (a multiple of :func:`hit_unit`, at most ``limit``) every group can serve.

    ``keys[g]`` are group ``g``'s block keys; ``count_prefix(keys)`` is the store's count of
    leading stored keys; ``computed`` tokens are vLLM's local hit. Returns ``computed`` when
    no longer hit exists.
    """
    unit = hit_unit(groups)
    top = limit // unit * unit
    for g, group in enumerate(groups):  # full attention groups bound the hit with one lookup each
        if group.kind == "full" and top > computed:
            first = computed // group.block_size
            top = min(top, (first + count_prefix(g, keys[g][first : top // group.block_size])) * group.block_size)
            top = top // unit * unit
    for boundary in range(top, computed, -unit):
        if all(
            group.kind == "full" or _serves(g, group, keys[g], count_prefix, computed, boundary)
            for g, group in enumerate(groups)
        ):
            return boundary
    return computed


def _serves(
    g: int,
    group: GroupSpec,
    keys: Sequence[bytes],
    count_prefix: Callable[[int, Sequence[bytes]], int],
    computed: int,
    end: int,
) -> bool:
    span = group.to_load(computed // group.block_size, end // group.block_size)
    if span.stop > len(keys):
        return False
    return not span or count_prefix(g, keys[span.start : span.stop]) == len(span)


__all__ = ["KINDS", "GroupSpec", "best_boundary", "group_layout", "groups_from_vllm", "hit_unit"]
