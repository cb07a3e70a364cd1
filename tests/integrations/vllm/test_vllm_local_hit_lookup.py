"""The store scheduler half looks blocks up from vLLM's local prefix-cache hit onward.

vLLM asks ``get_num_new_matched_tokens(request, num_computed_tokens)`` with its own local
hit; the blocks before it are in vLLM's cache, so the store is asked only about the keys
from that block on, and what it holds there is offered even when it no longer holds the
blocks before (keys chain from block 0, so a held key names the whole prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvdi.connectors.base import ConnectorContext, KVConnectorRole, KVRequest, ScheduledRequest, SchedulerOutput
from kvdi.connectors.store import StoreSchedulerConnector
from kvdi.connectors.store.keys import block_keys
from kvdi.connectors.store.scheduler import StoreTransferMetadata
from kvdi.layout import KVCacheSpec
from kvdi.settings import KvdiSettings

LAYOUT = KVCacheSpec("t", 2, 2, 8, 4, "float32")
PROMPT = KVRequest("r", tuple(range(3, 21)), None)  # 18 tokens: 4 full blocks and 2 tokens
KEYS = block_keys(PROMPT.prompt_token_ids, LAYOUT)


class CountingStore:
    """Holds a set of keys; records every key list count_prefix was asked about."""

    def __init__(self, held: Sequence[bytes]) -> None:
        self.held = set(held)
        self.asked: list[list[bytes]] = []

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        self.asked.append(list(keys))
        n = 0
        while n < len(keys) and keys[n] in self.held:
            n += 1
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [None for _ in keys]

    def put_many(self, items: Sequence[object]) -> int:
        return len(items)

    def discard(self, key: bytes) -> None:
        self.held.discard(key)

    def close(self) -> None:
        return None


def scheduler(store: CountingStore, role: str = "kv_both") -> StoreSchedulerConnector:
    settings = KvdiSettings(kv_role=role, engine_id="test")
    return StoreSchedulerConnector(
        ConnectorContext("test_store", KVConnectorRole.SCHEDULER, settings, LAYOUT, None, store)
    )


def test_lookup_starts_at_the_local_hit() -> None:
    store = CountingStore(KEYS)
    half = scheduler(store)

    assert half.get_num_new_matched_tokens(PROMPT, 8) == (8, False)

    assert store.asked == [KEYS[2:]]
    assert half.stats.lookup_hit_blocks == 2


def test_blocks_after_the_local_hit_are_offered_when_the_store_lost_the_ones_before() -> None:
    store = CountingStore(KEYS[2:])  # e.g. evicted: only blocks 2 and 3 left
    half = scheduler(store)

    assert half.get_num_new_matched_tokens(PROMPT, 0) == (0, False)  # no local hit: the chain is broken at 0
    assert half.get_num_new_matched_tokens(PROMPT, 8) == (8, False)  # local hit of 2 blocks: 2 and 3 load


def test_local_hit_covering_every_stored_block_offers_nothing_and_asks_only_beyond_it() -> None:
    store = CountingStore(KEYS)
    half = scheduler(store)

    assert half.get_num_new_matched_tokens(PROMPT, 16) == (0, False)

    assert store.asked == []  # nothing beyond the hit to ask about: no store round trip
    assert half.stats.lookup_hit_blocks == 0


ALIGNED = KVRequest("a", tuple(range(3, 19)), None)  # 16 tokens: 4 full blocks, 3 loadable (the last token computes)
ALIGNED_KEYS = block_keys(ALIGNED.prompt_token_ids, LAYOUT)


def test_local_hit_covering_every_loadable_block_costs_no_store_round_trip() -> None:
    """vLLM holds the 3 loadable blocks: the store is not asked about the last full block (computed anyway)."""
    store = CountingStore(ALIGNED_KEYS)
    half = scheduler(store)

    assert half.get_num_new_matched_tokens(ALIGNED, 12) == (0, False)

    assert store.asked == []


def test_last_full_block_saved_lately_is_not_saved_again_after_a_full_local_hit() -> None:
    """A prompt this half planned to save, computed again over vLLM's local hit, plans no save of its last block."""
    half = scheduler(CountingStore([]))
    first = KVRequest("first", ALIGNED.prompt_token_ids, None)
    half.get_num_new_matched_tokens(first, 0)
    meta = half.build_connector_meta(SchedulerOutput(1, (ScheduledRequest(first, (0, 1, 2, 3), 0, 16),)))
    assert isinstance(meta, StoreTransferMetadata)
    assert [t.block_keys for t in meta.saves] == [tuple(ALIGNED_KEYS)]

    half.get_num_new_matched_tokens(ALIGNED, 12)  # vLLM's own cache holds blocks 0-2
    again = half.build_connector_meta(SchedulerOutput(2, (ScheduledRequest(ALIGNED, (0, 1, 2, 4), 12, 4),)))
    assert isinstance(again, StoreTransferMetadata)

    assert again.saves == ()


def test_last_full_block_never_saved_here_is_saved_after_a_full_local_hit() -> None:
    """Without a save of it planned lately, the last full block is saved (no store round trip to find out)."""
    store = CountingStore([])
    half = scheduler(store)
    half.get_num_new_matched_tokens(ALIGNED, 12)
    meta = half.build_connector_meta(SchedulerOutput(1, (ScheduledRequest(ALIGNED, (0, 1, 2, 4), 12, 4),)))
    assert isinstance(meta, StoreTransferMetadata)

    assert [t.block_keys for t in meta.saves] == [(ALIGNED_KEYS[3],)]
    assert store.asked == []


def test_waiting_request_asked_again_at_the_same_local_hit_is_looked_up_once() -> None:
    """vLLM asks every step while a request waits for room: the store answers the first time only."""
    store = CountingStore(KEYS)
    half = scheduler(store)

    answers = [half.get_num_new_matched_tokens(PROMPT, 8) for _ in range(3)]

    assert answers == [(8, False)] * 3
    assert store.asked == [KEYS[2:]]
    assert half.stats.lookup_hit_blocks == 6  # each answer still counts as the hit it offers


def test_request_looked_up_after_it_was_scheduled_asks_the_store_again() -> None:
    """Once vLLM allocated it (scheduled), a later lookup (after a preemption) asks the store again, once."""
    store = CountingStore(KEYS)
    half = scheduler(store)
    half.get_num_new_matched_tokens(PROMPT, 8)
    half.update_state_after_alloc(PROMPT, [0, 1, 2, 3], 8)

    half.get_num_new_matched_tokens(PROMPT, 8)
    half.get_num_new_matched_tokens(PROMPT, 8)

    assert store.asked == [KEYS[2:], KEYS[2:]]
