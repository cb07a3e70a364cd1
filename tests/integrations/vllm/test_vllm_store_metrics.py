"""A worker rank's store metrics for Prometheus (vLLM-free): evictions counted, store sizes as a gauge, real stores."""

from __future__ import annotations

from pathlib import Path

from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.integrations.vllm.fleet.ledger import drain, sink
from kvdi.integrations.vllm.fleet.store_metrics import StoreCounters

FRAME = b"x" * 1000


def test_evictions_are_counted_once_each_and_queued_for_events(tmp_path: Path) -> None:
    """The size cap's evictions become ``evicted_blocks`` in the next entry (once), and their keys still reach the
    event queue."""
    store = FileBlockStore(tmp_path / "kv", max_bytes=3500)
    counters = StoreCounters("worker", "0-0", None, [store])
    queue = sink()
    store.watch_evictions(counters.evictions(queue))
    store.put_many([(bytes([i]) * 16, [FRAME]) for i in range(4)])
    gone = drain(queue)
    assert gone
    entry = counters.entry(None)
    assert entry is not None and entry["c|worker|evicted_blocks"] == len(gone)
    assert "c|worker|evicted_blocks" not in (counters.entry(None) or {})


def test_evictions_are_counted_without_events() -> None:
    """With KV cache events off (no queue) the host pool's LRU evictions are still counted."""
    pool = HostPoolStore(num_slots=2, slot_bytes=64)
    counters = StoreCounters("worker", "0-0", None, [pool])
    pool.watch_evictions(counters.evictions(None))
    pool.put_many([(bytes([i]) * 16, [b"1"]) for i in range(3)])
    assert (counters.entry(None) or {})["c|worker|evicted_blocks"] == 1


def test_store_bytes_gauge_by_store_kind_when_it_changes(tmp_path: Path) -> None:
    """Each sized store sends its bytes under its kind (host, disk) when they change; an uncapped folder (size not
    measured) sends nothing."""
    pool, capped, uncapped = (
        HostPoolStore(4, 64),
        FileBlockStore(tmp_path / "a", max_bytes=1 << 20),
        FileBlockStore(tmp_path / "b"),
    )
    counters = StoreCounters("worker", "1-0", None, [pool, capped, uncapped])
    tiers = {  # the first entry also describes the tiers, once (vLLM's kv_offload_config_info)
        "g|worker|1-0|tier_info|0:host|HostPoolStore": 1.0,
        "g|worker|1-0|tier_info|1:disk|FileBlockStore": 1.0,
        "g|worker|1-0|tier_info|2:disk|FileBlockStore": 1.0,
    }
    assert counters.entry(None) == {"g|worker|1-0|store_bytes|host": 0.0, "g|worker|1-0|store_bytes|disk": 0.0, **tiers}
    pool.put_many([(b"a" * 16, [b"1"])])
    capped.put_many([(b"b" * 16, [FRAME])])
    uncapped.put_many([(b"c" * 16, [FRAME])])
    assert counters.entry(None) == {"g|worker|1-0|store_bytes|host": 64.0, "g|worker|1-0|store_bytes|disk": 1000.0}
    assert counters.entry(None) is None
