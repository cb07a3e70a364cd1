"""The scheduler's key-only view of a worker-local store (kvdi.integrations.vllm.block_index), without vLLM."""

from __future__ import annotations

from kvdi.allocator import KVCacheSpec
from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.integrations.vllm.block_index import BlockIndex, store_capacity_blocks


def test_block_index_counts_reported_prefixes_and_evicts_least_recent() -> None:
    index = BlockIndex(capacity=3)
    index.add([b"a", b"b"])
    assert index.count_prefix([b"a", b"b", b"c"]) == 2
    index.add([b"c", b"d"])  # over capacity: the least recently used key goes (b; a was the head of a hit)
    assert len(index) == 3 and index.count_prefix([b"b"]) == 0 and index.count_prefix([b"a"]) == 1
    index.discard(b"c")
    assert index.count_prefix([b"c", b"d"]) == 0 and index.count_prefix([b"d"]) == 1


def test_put_many_reports_every_key_written_and_payloads_are_never_served() -> None:
    index = BlockIndex(capacity=4)
    assert index.put_many([(b"a", [b"x"]), (b"b", [b"y"])]) == 2
    assert index.get_many([b"a", b"b"]) == [None, None] and index.count_prefix([b"a", b"b"]) == 2


def test_capacity_comes_from_the_backend() -> None:
    layout = KVCacheSpec("m", 2, 2, 32, 32, "float32")
    pool = HostPoolStore(num_slots=7, slot_bytes=layout.block_bytes)
    assert store_capacity_blocks(pool) == 7
    assert store_capacity_blocks(object()) is None
