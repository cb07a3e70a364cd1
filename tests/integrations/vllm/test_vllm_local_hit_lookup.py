"""The store scheduler half looks blocks up from vLLM's local prefix-cache hit onward.

vLLM asks ``get_num_new_matched_tokens(request, num_computed_tokens)`` with its own local
hit; the blocks before it are in vLLM's cache, so the store is asked only about the keys
from that block on, and what it holds there is offered even when it no longer holds the
blocks before (keys chain from block 0, so a held key names the whole prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvdi.connectors.base import ConnectorContext, KVConnectorRole, KVRequest
from kvdi.connectors.store import StoreSchedulerConnector
from kvdi.connectors.store.keys import block_keys
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
