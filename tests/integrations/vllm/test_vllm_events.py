"""The bookkeeping behind kvdi's KV cache events and Prometheus entry, without vLLM: what the worker
reports (landed saves, evictions, corrupt drops from real stores) and how the scheduler joins ranks."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest

from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata
from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.multi import TieredStore
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store.keys import block_keys
from kvdi.connectors.store.protocol import health_checks, leaf_stores
from kvdi.integrations.vllm.fleet.counters import FleetCounters, breaker_states, merge_entries
from kvdi.integrations.vllm.fleet.ledger import BlockFacts, SchedulerLedger, WorkerLedger, drain, sink
from kvdi.integrations.vllm.parallel import AllRanksStore, RankSlice
from tests.helpers.store import Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))  # 4 full blocks
FACTS = BlockFacts(b"h" * 32, None, (1, 2, 3, 4), None, None)


def test_a_block_is_stored_once_every_rank_landed_it_across_steps() -> None:
    """With 2 ranks, one rank's report is not enough; the second (a step later) completes it, once."""
    ledger = SchedulerLedger(num_ranks=2)
    ledger.planned(b"k", FACTS)
    assert ledger.landed(b"k", "STORAGE", "REMOTE") is None
    assert ledger.landed(b"k", "STORAGE", "REMOTE") == FACTS
    assert ledger.landed(b"k", "STORAGE", "REMOTE") is None  # a third report starts a new count


def test_removed_is_announced_once_and_only_for_announced_blocks() -> None:
    ledger = SchedulerLedger(num_ranks=1)
    ledger.planned(b"k", FACTS)
    assert ledger.removed(b"k", "STORAGE") is None  # never announced stored: routers never learnt it
    assert ledger.landed(b"k", "STORAGE", "REMOTE") == FACTS
    assert ledger.removed(b"k", "CPU") is None  # another medium
    assert ledger.removed(b"k", "STORAGE") == FACTS.block_hash
    assert ledger.removed(b"k", "STORAGE") is None


def test_an_unplanned_block_lands_without_an_event_and_clear_forgets() -> None:
    ledger = SchedulerLedger(num_ranks=1)
    assert ledger.landed(b"x", "STORAGE", None) is None
    ledger.planned(b"k", FACTS)
    ledger.clear()
    assert ledger.landed(b"k", "STORAGE", None) is None


def test_worker_ledger_maps_rank_slice_keys_back_to_block_keys() -> None:
    """A TP rank saves its slice under its own key; the events speak of the block key, also for a slice of
    another rank (a shared folder's size cap evicts whichever slice is oldest)."""
    shape = RankSlice(tp_size=2, tp_rank=1)
    ledger = WorkerLedger([r.key for r in shape.ranks()])
    keys = tuple(block_keys(PROMPT.prompt_token_ids, LAYOUT))
    ledger.saw(BlockTransferMetadata((), (BlockTransfer("r", (1, 2, 3, 4), keys),)))
    mine = [shape.key(k) for k in keys]
    other = RankSlice(tp_size=2, tp_rank=0).key(keys[0])
    assert list(ledger.block_keys([*mine, b"unknown-key-1234", other])) == [*keys, keys[0]]
    assert list(WorkerLedger().block_keys(keys)) == list(keys)  # one rank: keys are block keys


def test_worker_half_reports_landed_saves_and_dropped_corrupt_blocks(tmp_path: Path) -> None:
    """A real store worker watched through ``watch_blocks``: every saved block is reported landed (after its
    asynchronous save finished), a corrupt one is reported dropped when a load finds it."""
    store = FileBlockStore(tmp_path / "kv")
    producer = Engine(store, LAYOUT, make_settings())
    landed: deque[tuple[bool, bytes]] = deque()
    producer.worker.watch_blocks(lambda ok, key: landed.append((ok, key)))
    producer.prefill(PROMPT, (1, 2, 3, 4, 5))
    keys = block_keys(PROMPT.prompt_token_ids, LAYOUT)
    assert drain(landed) == [(True, k) for k in keys]
    path = store.path_for(keys[1])
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    consumer = Engine(store, LAYOUT, make_settings())
    dropped: deque[tuple[bool, bytes]] = deque()
    consumer.worker.watch_blocks(lambda ok, key: dropped.append((ok, key)))
    consumer.prefill(PROMPT, (6, 7, 8, 9, 10))
    assert (False, keys[1]) in drain(dropped)


def test_shared_storage_size_cap_reports_evicted_keys(tmp_path: Path) -> None:
    """The size cap's LRU eviction names the keys it removed (oldest first), when someone listens."""
    frame = b"x" * 1000
    store = FileBlockStore(tmp_path / "kv", max_bytes=3500)
    evicted = sink()
    store.watch_evictions(evicted.append)
    store.put_many([(bytes([i]) * 16, [frame]) for i in range(3)])
    assert drain(evicted) == []
    store.put_many([(bytes([9]) * 16, [frame])])
    gone = drain(evicted)
    assert gone and set(gone) <= {bytes([i]) * 16 for i in range(3)}
    assert all(store.count_prefix([k]) == 0 for k in gone)


def test_cpu_offload_lru_reports_evicted_keys() -> None:
    """The host pool's LRU names each block it evicts to its watcher."""
    pool = HostPoolStore(num_slots=2, slot_bytes=64)
    evicted = sink()
    pool.watch_evictions(evicted.append)
    pool.put_many([(b"a" * 16, [b"1"]), (b"b" * 16, [b"2"])])
    pool.put_many([(b"c" * 16, [b"3"])])
    assert drain(evicted) == [b"b" * 16]  # a batch's tail is least recently used


def test_leaf_stores_unwrap_multi_and_the_all_ranks_wrapper(tmp_path: Path) -> None:
    """Composite stores list their parts: multi's tiers in order, a wrapper's backend."""
    disk, host = FileBlockStore(tmp_path / "kv"), HostPoolStore(2, 64)
    multi = TieredStore([("cpu_offload", host), ("shared_storage", disk)])
    assert leaf_stores(multi) == [host, disk]
    assert leaf_stores(disk) == [disk]
    assert leaf_stores(AllRanksStore(multi, RankSlice(tp_size=2))) == [host, disk]


def test_misses_gauges_and_histograms_in_the_prometheus_entry() -> None:
    """Misses are blocks asked for and not offered; per-step seconds become one observation; a gauge is
    sent only when it changed."""
    counters = FleetCounters("scheduler", "0-0")
    counters.looked_up(prompt_tokens=100, num_computed_tokens=32, matched_tokens=32, block_size=32)
    entry = counters.entry({"lookups": 1, "load_seconds": 0.25})
    assert entry == {"c|scheduler|lookups": 1, "c|scheduler|lookup_miss_blocks": 1, "h|scheduler|load_seconds": [0.25]}
    assert counters.entry(None) is None

    class Half:  # declares the gauges of WorkerGauges
        inflight_bytes = 4096
        staged_bytes: int | None = None

    half = Half()
    worker = FleetCounters("worker", "1-0", half)
    assert worker.entry(None) == {"g|worker|1-0|inflight_bytes|": 4096.0}
    assert worker.entry(None) is None
    half.staged_bytes = 98568
    assert worker.entry(None) == {"g|worker|1-0|prefetch_staged_bytes|": 98568.0}


def test_merged_entries_sum_counters_and_join_observations() -> None:
    a = {"c|worker|saved_blocks": 2, "h|worker|save_seconds": [0.1], "g|worker|0-0|inflight_bytes|": 5.0}
    b = {"c|worker|saved_blocks": 3, "h|worker|save_seconds": [0.2], "c|scheduler|lookups": 1}
    merged = merge_entries(a, b)
    assert merged["c|worker|saved_blocks"] == 5 and merged["h|worker|save_seconds"] == [0.1, 0.2]
    assert merged["c|scheduler|lookups"] == 1 and merged["g|worker|0-0|inflight_bytes|"] == 5.0
    assert a["h|worker|save_seconds"] == [0.1]  # inputs untouched


@pytest.mark.redis
def test_breaker_states_name_each_redis_node(redis_server_factory: object) -> None:
    """A real server that dies opens its breaker after the failures it allows; the entry says so."""
    from kvdi.connectors.redis import RedisBlockStore
    from kvdi.settings import RedisSettings

    server = redis_server_factory()  # type: ignore[operator]
    options = RedisSettings(url=server.url, breaker_failures=1, op_timeout_s=0.5, connect_timeout_s=0.5)
    store = RedisBlockStore(options)
    checks = health_checks(TieredStore([("redis", store)]))  # found through multi's parts
    try:
        assert breaker_states(checks) == {store.url: False}
        server.stop()
        with pytest.raises(ConnectionError):
            store.count_prefix([b"k" * 16])
        assert breaker_states(checks) == {store.url: True}
    finally:
        store.close()
