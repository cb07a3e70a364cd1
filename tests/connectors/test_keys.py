"""Block keys: prefix-chained, per full block, seeded by layout fingerprint and salt."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdi.connectors.store.keys import KEY_BYTES, block_keys, compose_salt
from kvdi.layout import KVCacheSpec

LAYOUT = KVCacheSpec("m", 2, 2, 8, 4, "float32")
tokens = st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=40)


@settings(deadline=None)
@given(tokens)
def test_one_key_per_full_block(ids: list[int]) -> None:
    keys = block_keys(ids, LAYOUT)
    assert len(keys) == len(ids) // LAYOUT.block_size
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)


@settings(deadline=None)
@given(tokens, tokens)
def test_same_prefix_gives_same_keys(prefix: list[int], tail: list[int]) -> None:
    full = block_keys(prefix + tail, LAYOUT)
    alone = block_keys(prefix, LAYOUT)
    assert full[: len(alone)] == alone


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=4, max_size=40), st.data())
def test_changing_block_i_changes_keys_from_i_to_end_only(ids: list[int], data: st.DataObject) -> None:
    pos = data.draw(st.integers(0, len(ids) // LAYOUT.block_size * LAYOUT.block_size - 1))
    changed = list(ids)
    changed[pos] = ids[pos] + 1 + data.draw(st.integers(0, 5))
    before, after = block_keys(ids, LAYOUT), block_keys(changed, LAYOUT)
    i = pos // LAYOUT.block_size
    assert before[:i] == after[:i]
    assert all(b != a for b, a in zip(before[i:], after[i:], strict=True))


@settings(deadline=None)
@given(tokens.filter(lambda t: len(t) >= 4), st.text(max_size=8), st.text(max_size=8))
def test_salt_isolates(ids: list[int], salt_a: str, salt_b: str) -> None:
    same = salt_a == salt_b
    a, b = block_keys(ids, LAYOUT, salt_a), block_keys(ids, LAYOUT, salt_b)
    assert (a == b) is same
    assert block_keys(ids, LAYOUT, None) != block_keys(ids, LAYOUT, "")


@settings(deadline=None)
@given(tokens.filter(lambda t: len(t) >= 8))
def test_layout_fingerprint_seeds_the_chain(ids: list[int]) -> None:
    other = KVCacheSpec("m", 2, 2, 8, 4, "float16")
    assert set(block_keys(ids, LAYOUT)).isdisjoint(block_keys(ids, other))


def test_keys_are_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from kvdi.layout import KVCacheSpec; from kvdi.connectors.store.keys import block_keys; "
        "print(block_keys(list(range(8)), KVCacheSpec('m', 2, 2, 8, 4, 'float32'), 'salt')[1].hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == block_keys(list(range(8)), LAYOUT, "salt")[1].hex()


def test_token_boundaries_do_not_collide() -> None:
    a = KVCacheSpec("m", 1, 1, 1, 2, "float32")
    assert block_keys([1, 23], a) != block_keys([12, 3], a)


def test_a_lone_surrogate_salt_gives_keys_distinct_from_other_salts() -> None:
    ids = list(range(8))
    lone = block_keys(ids, LAYOUT, "tenant-\ud800")
    assert len(lone) == 2
    assert lone != block_keys(ids, LAYOUT, "tenant-\udfff")
    assert lone != block_keys(ids, LAYOUT, "tenant-")


tricky = st.text(alphabet=st.one_of(st.characters(), st.sampled_from(["\ud800", "\udc00", "|", ":", "1", "s", "l"])))
SaltInputs = tuple[str | None, str | None, tuple[str, ...]]
salt_inputs = st.tuples(st.none() | tricky, st.none() | tricky, st.lists(tricky, max_size=3).map(tuple))


@settings(max_examples=300, deadline=None)
@given(salt_inputs, salt_inputs)
def test_composed_salts_differ_whenever_the_inputs_differ(a: SaltInputs, b: SaltInputs) -> None:
    assert (compose_salt(*a) == compose_salt(*b)) is (a == b)


def test_composed_salt_is_none_only_without_any_part() -> None:
    assert compose_salt(None) is None
    assert compose_salt("") is not None
    assert compose_salt(None, "adapter") != compose_salt("adapter")
    assert compose_salt("a|l1:b") != compose_salt("a", "b")  # the separator inside a part cannot forge a part
