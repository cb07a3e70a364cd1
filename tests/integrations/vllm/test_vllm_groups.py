"""Per-group planning rules (kvdi.integrations.vllm.groups), on plain data (vLLM's own types: tests/real_vllm).

Hits per group as vLLM computes its own: full attention needs the whole prefix, a sliding
window the blocks inside the window at the boundary, Mamba one state at the boundary; the
hit offered is the longest prefix every group serves. Each group's layout (and so its keys
and frames) names its kind, window, layers and block size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from kvdi.connectors.store.keys import block_keys
from kvdi.errors import ConfigError
from kvdi.integrations.vllm.groups import GroupSpec, best_boundary, group_layout, groups_from_vllm, hit_unit
from kvdi.layout import KVCacheSpec

BASE = KVCacheSpec("m", 4, 2, 8, 4, "float32")
FULL = GroupSpec(0, "full", ("l.0", "l.2"), 4)
SLIDING = GroupSpec(1, "sliding", ("l.1", "l.3"), 4, window=8)  # cdiv(8 - 1, 4) = 2 blocks
MAMBA = GroupSpec(1, "mamba", ("l.1",), 4, page_bytes=96)
TOKENS = tuple(range(3, 27))  # 24 tokens: 6 blocks


# Stand-ins named like vLLM's spec classes (kinds are read from the class name).
@dataclass
class FullAttentionSpec:
    block_size: int = 4
    num_kv_heads: int = 2
    head_size: int = 8


@dataclass
class SlidingWindowSpec(FullAttentionSpec):
    sliding_window: int = 8


@dataclass
class CrossAttentionSpec(FullAttentionSpec):
    pass


@dataclass
class Group:
    kv_cache_spec: object
    layer_names: list[str] = field(default_factory=lambda: ["l.0"])


def _lookup(held: set[bytes]) -> Callable[[int, Sequence[bytes]], int]:
    def count_prefix(group: int, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in held:
            n += 1
        return n

    return count_prefix


def _keys(groups: Sequence[GroupSpec]) -> list[list[bytes]]:
    return [block_keys(TOKENS, group_layout(BASE, g)) for g in groups]


def test_full_attention_loads_the_whole_prefix_after_the_local_hit() -> None:
    assert list(FULL.to_load(1, 5)) == [1, 2, 3, 4]
    assert FULL.to_save(0, 6, 24) == [0, 1, 2, 3, 4, 5]


def test_sliding_window_loads_and_stores_only_blocks_in_the_window() -> None:
    assert SLIDING.window_blocks == 2
    assert list(SLIDING.to_load(0, 5)) == [3, 4]
    assert list(SLIDING.to_load(4, 5)) == [4]  # block 3 is in vLLM's cache already
    # 24 tokens: hits at 5 blocks (loadable) or 6 (a longer prompt): blocks 3, 4, 5 only
    assert SLIDING.to_save(0, 6, 24) == [3, 4, 5]
    assert SLIDING.to_save(0, 6, 25) == [4, 5]  # loadable = full = 6


def test_mamba_loads_and_stores_one_state_at_the_boundary() -> None:
    assert list(MAMBA.to_load(0, 5)) == [4]
    assert MAMBA.to_save(0, 6, 24) == [4, 5]
    assert MAMBA.to_save(0, 6, 25) == [5]


def test_the_hit_is_the_longest_prefix_every_group_serves() -> None:
    groups = [FULL, SLIDING]
    keys = _keys(groups)
    full_all = set(keys[0])
    window_at_4 = {keys[1][2], keys[1][3]}
    count_prefix = _lookup(full_all | window_at_4)
    assert best_boundary(groups, keys, count_prefix, 0, 20) == 16  # sliding serves only the boundary at 4 blocks
    assert best_boundary(groups, keys, _lookup(full_all), 0, 20) == 0  # no window stored anywhere
    assert best_boundary(groups, keys, _lookup(set(keys[0][:2]) | window_at_4), 0, 20) == 0  # full stops at 2
    assert best_boundary(groups, keys, count_prefix, 16, 20) == 16  # nothing beyond vLLM's local hit


def test_a_window_cut_by_the_local_hit_needs_only_the_blocks_after_it() -> None:
    groups = [FULL, SLIDING]
    keys = _keys(groups)
    held = set(keys[0]) | {keys[1][4]}  # the local hit holds block 3 of the window at 5 blocks
    assert best_boundary(groups, keys, _lookup(held), 16, 20) == 20


def test_hit_unit_is_a_multiple_of_every_block_size() -> None:
    assert hit_unit([FULL, GroupSpec(1, "mamba", ("x",), 6)]) == 12


def test_group_layouts_differ_by_kind_layers_and_block_size() -> None:
    prints = {
        group_layout(BASE, g).fingerprint()
        for g in (
            FULL,
            SLIDING,
            GroupSpec(0, "full", ("l.0", "l.1"), 4),
            GroupSpec(0, "full", ("l.0", "l.2"), 8),
            GroupSpec(1, "sliding", ("l.1", "l.3"), 4, window=16),
        )
    }
    assert len(prints) == 5
    assert group_layout(BASE, FULL).num_layers == 2
    assert BASE.fingerprint() not in prints


def test_a_single_group_layout_keeps_its_fingerprint() -> None:
    """Stored KV of single-group engines stays loadable: the new layout fields are out of its fingerprint."""
    import hashlib

    from kvdi.layout import FORMAT_VERSION

    text = f"m|float32|4|2|8|4|{FORMAT_VERSION}"
    assert BASE.fingerprint() == hashlib.blake2b(text.encode(), digest_size=16).digest()


def test_mamba_layout_counts_its_page_bytes() -> None:
    assert group_layout(BASE, MAMBA).layer_block_bytes == 96


def test_groups_are_read_from_vllms_config() -> None:
    config = SimpleNamespace(kv_cache_groups=[Group(FullAttentionSpec()), Group(SlidingWindowSpec(), ["l.1"])])
    full, sliding = groups_from_vllm(config)
    assert (full.kind, sliding.kind, sliding.window, sliding.layer_names) == ("full", "sliding", 8, ("l.1",))


@dataclass
class MambaSpec:
    block_size: int = 544
    page_size_bytes: int = 1024
    mamba_cache_mode: str = "none"


def test_a_mamba_group_without_states_at_block_boundaries_is_refused() -> None:
    """With prefix caching off vLLM keeps only the running state: nothing kvdi could key by a prefix."""
    with pytest.raises(ConfigError, match="mamba_cache_mode='align'"):
        groups_from_vllm(SimpleNamespace(kv_cache_groups=[Group(MambaSpec())]))
    (group,) = groups_from_vllm(SimpleNamespace(kv_cache_groups=[Group(MambaSpec(mamba_cache_mode="align"))]))
    assert (group.kind, group.page_bytes, group.block_size) == ("mamba", 1024, 544)


def test_an_unknown_group_kind_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="CrossAttentionSpec.*disable-hybrid-kv-cache-manager"):
        groups_from_vllm(SimpleNamespace(kv_cache_groups=[Group(CrossAttentionSpec())]))
