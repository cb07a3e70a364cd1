"""A store written only against docs/store-backend.md gets kvdi's fleet features in vLLM, with no other change.

The page's own SQLite example (loaded from its code block) sits under the real store halves and the
adapter's fleet hooks, which speak vLLM's types: its saves become vLLM ``BlockStored`` events and its
LRU evictions ``BlockRemoved`` ones (``watch_evictions``), its hits count under vLLM's ``disk`` source
(``hit_source``) and its ``health()`` is a breaker gauge in the Prometheus entry. No engine starts:
what an engine adds (vLLM's publisher, ranks joined by the scheduler) is tests/real_vllm/test_vllm_fleet.py's.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.helpers.docs_example import docs_example_module
from tests.real_vllm.vllm_support import require_vllm

require_vllm()


def test_the_docs_example_store_gets_events_hit_sources_and_health(tmp_path: Path) -> None:
    """Saves land as BlockStored, evictions go out as BlockRemoved, hits count as disk, health is a gauge."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvdi.connectors.base import KVRequest
    from kvdi.connectors.store.keys import block_keys
    from kvdi.integrations.vllm.fleet.events import SchedulerFleet, WorkerFleet, events_enabled
    from kvdi.integrations.vllm.parallel import RankSlice
    from kvdi.integrations.vllm.requests import RequestTracker
    from kvdi.testing.conformance import FRAME_BYTES, LAYOUT, Halves

    events_on = events_enabled(SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True)))

    first, second = (KVRequest(f"r{i}", tuple(range(i * 100, i * 100 + 18))) for i in range(2))  # 4 blocks each
    with docs_example_module(tmp_path) as example:
        store = example.SqliteBlockStore(tmp_path / "kv.sqlite3", FRAME_BYTES, 4)  # holds one prompt's blocks
        try:
            engine = Halves(store, seed=1)
            worker = WorkerFleet(engine.worker, RankSlice(), events_on)
            engine.prefill(first)
            reported = worker.kv_cache_events()
            assert reported is not None
            stored = [e for e in reported.get_all_events() if isinstance(e, BlockStored)]
            assert [e.block_hashes[0] for e in stored] == block_keys(first.prompt_token_ids, LAYOUT)
            assert {(e.medium, e.locality) for e in stored} == {("STORAGE", "REMOTE")}

            Halves(store, seed=2).prefill(second)  # another engine on the store: its saves evict the first's
            reported = worker.kv_cache_events()
            assert reported is not None
            removed = {e.block_hashes[0] for e in reported.get_all_events() if isinstance(e, BlockRemoved)}
            assert removed == set(block_keys(first.prompt_token_ids, LAYOUT))

            scheduler = SchedulerFleet(Halves(store).scheduler, LAYOUT, RankSlice(), RequestTracker(), events_on=False)
            scheduler.looked_up(second, 0, 16)
            assert scheduler.hit_sources(SimpleNamespace(request_id="r1"), 16) == {CacheHitSource.DISK: 16}
            gauges = worker.counters.entry(None) or {}
            assert gauges["g|worker|0-0|breaker_open|sqlite:kv.sqlite3"] == 0.0  # health(): the file serves
        finally:
            store.close()
