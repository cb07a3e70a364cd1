"""kvdi seen by the fleet, on one real ``vllm serve`` with a shared_storage store and KV cache events on.

A real ZMQ subscriber (bound on loopback, vLLM's publisher connects to it) decodes vLLM's
``KVEventBatch``es with msgspec as a router does, and ``/metrics`` is scraped over HTTP and
parsed with prometheus_client. One server, in order: a storing request (kvdi's
``BlockStored`` carry the hashes vLLM published for the same GPU blocks), a loading request
after vLLM's own prefix cache is reset (kvdi's hits under ``source="disk"``), a request that
pushes the store past its size cap (``BlockRemoved`` for the evicted blocks), a reset with
``reset_external`` (kvdi's ``BlockRemoved`` for what it announced, vLLM's own
``AllBlocksCleared``; nothing stored before it is offered again), and kvdi's series equal to
kvdi's own stats files. The same server's ``/metrics`` has every kvdi series at 0 before the
first request, and every series the shipped Grafana dashboard and alert rules query.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.deploy import series_used
from tests.real_vllm.fleet_support import EventSubscriber, FleetServer, exposed, scrape, series
from tests.real_vllm.serve_support import model_with_tokenizer, word
from tests.real_vllm.vllm_support import BLOCK_SIZE, kv_config, read_stats, read_stats_settled, require_vllm

require_vllm()

pytestmark = pytest.mark.slow

FRAME_BYTES = 72 + 2 * 2 * 2 * 32 * BLOCK_SIZE * 4  # header + 2 layers x K,V x 2 KV heads x 32 dims x fp32
SLICE_BYTES = 72 + (FRAME_BYTES - 72) // 2  # TP=2: each rank stores half of the KV heads
CAP_OBJECTS = 5  # the store holds 5 blocks: prompt A (3) then prompt B (4) evicts A's


class Fleet:
    def __init__(self, server: FleetServer, events: EventSubscriber, stats: Path, store: Path) -> None:
        self.server, self.events, self.stats, self.store = server, events, stats, store

    def complete(self, prompt: list[int]) -> str:
        return self.server.complete(" ".join(word(t) for t in prompt))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("fleet")
    model = model_with_tokenizer(tiny_model, work / "model")
    events = EventSubscriber()
    kv = kv_config(
        "shared_storage",
        stats_dir=work / "stats",
        shared_storage__path=str(work / "store"),
        shared_storage__max_bytes=CAP_OBJECTS * FRAME_BYTES,
        transfer__async_save=True,
    )
    server = FleetServer(
        model,
        work / "serve.log",
        kv,
        env={"VLLM_SERVER_DEV_MODE": "1"},
        args=["--kv-events-config", events.events_config()],
    )
    try:
        server.wait_ready()
        yield Fleet(server, events, work / "stats", work / "store")
    finally:
        server.stop()
        events.close()


def _kvdi_stored(events: list[Any]) -> list[Any]:
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "STORAGE"]


def _gpu_stored(events: list[Any]) -> list[Any]:
    return [e for e in events if type(e).__name__ == "BlockStored" and e.medium == "GPU"]


def _kvdi_removed(events: list[Any]) -> set[Any]:
    """Hashes of kvdi's BlockRemoved events (told from vLLM's by ``ownership``)."""
    return {h for e in events if type(e).__name__ == "BlockRemoved" and e.ownership == "kvdi" for h in e.block_hashes}


def _kvdi_live(events: list[Any]) -> set[Any]:
    """Blocks kvdi announced stored and not (yet) removed."""
    return {e.block_hashes[0] for e in _kvdi_stored(events)} - _kvdi_removed(events)


def _gpu_blocks(events: list[Any]) -> dict[Any, tuple[Any, list[int]]]:
    """vLLM's own GPU-block events, one entry per block: hash -> (parent hash, token ids)."""
    out: dict[Any, tuple[Any, list[int]]] = {}
    for event in _gpu_stored(events):
        parent = event.parent_block_hash
        for j, block_hash in enumerate(event.block_hashes):
            out[block_hash] = (parent, event.token_ids[j * event.block_size : (j + 1) * event.block_size])
            parent = block_hash
    return out


def test_every_kvdi_series_has_a_sample_at_zero_before_the_first_request(fleet: Fleet) -> None:
    """Right after the server started (this module's first test), every kvdi counter and histogram has a sample at 0
    for both roles, and the in-flight gauge is named with its unit last."""
    from kvdi.integrations.vllm.fleet.prom import COUNTERS, HISTOGRAMS

    metrics = scrape(fleet.server)
    for role in ("scheduler", "worker"):
        for name, _doc in COUNTERS.values():
            assert (f"{name}_total", role) in {(n, dict(lab).get("role")) for n, lab in metrics}, (name, role)
            assert series(metrics, f"{name}_total", role=role) == 0
        for name, _doc in HISTOGRAMS.values():
            assert series(metrics, f"{name}_count", role=role) == 0
    names = {n for n, _ in metrics}
    assert "vllm:kvdi_in_flight_bytes" in names and "vllm:kvdi_bytes_in_flight" not in names


def test_events_metrics_hit_sources_and_reset(fleet: Fleet, prompts: list[list[int]]) -> None:
    """The whole story on one engine (see the module docstring); each step asserts what a router or a
    dashboard would see."""
    a, b = prompts[0], prompts[3]  # 100 tokens (3 full blocks), 130 tokens (4)
    a_blocks, b_blocks = len(a) // BLOCK_SIZE, len(b) // BLOCK_SIZE

    # 1. Storing round: kvdi announces A's blocks once they landed, with vLLM's own hashes.
    fleet.complete(a)
    seen = fleet.events.wait_for(lambda ev: len(_kvdi_stored(ev)) >= a_blocks)
    gpu = _gpu_blocks(seen)
    stored = _kvdi_stored(seen)
    assert len(stored) == a_blocks
    for i, event in enumerate(stored):
        assert len(event.block_hashes) == 1 and event.block_hashes[0] in gpu, "not a hash vLLM published for a block"
        parent, tokens = gpu[event.block_hashes[0]]
        assert event.token_ids == tokens == a[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        assert event.parent_block_hash == parent
        assert event.block_size == BLOCK_SIZE and event.locality == "REMOTE"
        assert event.ownership == "kvdi" and event.kv_cache_spec_kind == "full_attention" and event.group_idx == 0
    assert all(e.ownership is None for e in _gpu_stored(seen))  # vLLM's own events: told apart by a field
    a_hashes = [e.block_hashes[0] for e in stored]

    # 2. Loading round: vLLM's own cache reset (not kvdi's), A again loads from kvdi's disk store.
    assert fleet.server.post("/reset_prefix_cache")["success"] is True
    fleet.complete(a)
    hits = (len(a) - 1) // BLOCK_SIZE * BLOCK_SIZE
    metrics = _wait_metrics(fleet, lambda m: series(m, "vllm:prompt_tokens_cached_by_source_total", source="disk"))
    assert series(metrics, "vllm:prompt_tokens_cached_by_source_total", source="disk") == hits
    assert series(metrics, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
    assert series(metrics, "vllm:kvdi_loaded_blocks_total", role="worker", connector="shared_storage") == a_blocks
    # ... and a dashboard built for vLLM's own offloading connector sees kvdi's disk tier (vLLM 0.33's series names)
    loaded = series(metrics, "vllm:kvdi_loaded_bytes_total", role="worker")
    assert series(metrics, "vllm:kv_offload_config_info", tier="0:disk", connector="shared_storage") == 1
    assert series(metrics, "vllm:kv_offload_load_bytes_total") == loaded > 0
    assert series(metrics, "vllm:kv_offload_tiering_read_bytes_total", tier="0:disk") == loaded

    # 3. B pushes the store past its cap: A's blocks are evicted and announced removed.
    fleet.complete(b)
    seen = fleet.events.wait_for(lambda ev: sum(type(e).__name__ == "BlockRemoved" for e in ev) >= 1)
    seen = fleet.events.wait_for(lambda ev: len(_kvdi_stored(ev)) >= a_blocks + b_blocks)
    removed = [h for e in seen if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE" for h in e.block_hashes]
    assert removed and set(removed) <= set(a_hashes)
    assert all(e.ownership == "kvdi" for e in seen if type(e).__name__ == "BlockRemoved" and e.medium == "STORAGE")
    metrics = _wait_metrics(fleet, lambda m: series(m, "vllm:kvdi_evicted_blocks_total") >= len(removed))
    assert series(metrics, "vllm:kvdi_evicted_blocks_total", role="worker") >= len(removed)
    assert 0 < series(metrics, "vllm:kvdi_store_bytes", store="disk") <= CAP_OBJECTS * FRAME_BYTES

    # 4. reset_cache through vLLM: vLLM's AllBlocksCleared, and kvdi's BlockRemoved (ownership "kvdi") for every block
    # it announced and did not announce removed (B's); B is no longer offered, and is stored anew.
    before = len(fleet.events.events())
    live = _kvdi_live(fleet.events.events())
    assert live  # B's blocks
    hit_blocks = read_stats_settled(fleet.stats, "scheduler")["lookup_hit_blocks"]
    assert fleet.server.post("/reset_prefix_cache?reset_external=true")["success"] is True
    fleet.complete(b)  # events go out with the next engine step
    seen = fleet.events.wait_for(lambda ev: live <= _kvdi_removed(ev[before:]))
    seen = fleet.events.wait_for(lambda ev: len(_kvdi_stored(ev)) >= a_blocks + 2 * b_blocks)
    assert sum(type(e).__name__ == "AllBlocksCleared" for e in seen[before:]) == 1  # vLLM's; kvdi publishes none
    assert read_stats_settled(fleet.stats, "scheduler")["lookup_hit_blocks"] == hit_blocks
    assert [e.block_hashes[0] for e in _kvdi_stored(seen)[-b_blocks:]] == [
        e.block_hashes[0] for e in _kvdi_stored(seen)[a_blocks : a_blocks + b_blocks]
    ]

    # 5. Every kvdi series equals kvdi's own counters for the same run (the stats files).
    _assert_series_match_stats(fleet)


def test_every_series_of_the_dashboard_and_alert_rules_is_on_metrics(fleet: Fleet) -> None:
    """deploy/grafana/kvdi-dashboard.json and deploy/prometheus/kvdi-alerts.yml query only series this real
    ``vllm serve`` with kvdi exposes on /metrics (vLLM's and kvdi's)."""
    names = exposed(fleet.server)
    missing = {name: sorted(where) for name, where in series_used().items() if name not in names}
    assert not missing, missing


def _wait_metrics(fleet: Fleet, ready: Any, timeout: float = 30.0) -> dict[Any, float]:
    import time

    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(fleet.server)
        if ready(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def _assert_series_match_stats(fleet: Fleet) -> None:
    from kvdi.integrations.vllm.fleet.prom import COUNTERS

    def mismatches() -> list[str]:
        metrics = scrape(fleet.server)
        out = []
        for role in ("scheduler", "worker"):
            stats = read_stats(fleet.stats, role)
            for counter, (name, _doc) in COUNTERS.items():
                if counter not in stats:
                    continue
                got = series(metrics, f"{name}_total", role=role, connector="shared_storage")
                if got != stats[counter]:
                    out.append(f"{name}{{role={role}}} = {got}, stats file {stats[counter]}")
        return out

    import time

    deadline = time.monotonic() + 30
    while (bad := mismatches()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not bad, bad
    metrics = scrape(fleet.server)
    assert series(metrics, "vllm:kvdi_saved_blocks_total", role="worker") > 0
    assert series(metrics, "vllm:kvdi_miss_blocks_total", role="scheduler") > 0
    assert series(metrics, "vllm:kvdi_save_seconds_count", role="worker") > 0


@pytest.fixture(scope="module")
def tp2_fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Fleet]:
    """A TP=2 ``vllm serve`` (multiprocess executor): each rank saves its own slice of every block."""
    work = tmp_path_factory.mktemp("fleet-tp2")
    model = model_with_tokenizer(tiny_model, work / "model")
    events = EventSubscriber()
    kv = kv_config(
        "shared_storage",
        stats_dir=work / "stats",
        shared_storage__path=str(work / "store"),
        shared_storage__max_bytes=CAP_OBJECTS * SLICE_BYTES,  # each rank evicts once it wrote 5 slices
    )
    server = FleetServer(
        model,
        work / "serve.log",
        kv,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_SERVER_DEV_MODE": "1"},
        args=[
            "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
            "--kv-events-config", events.events_config(),
        ],
    )  # fmt: skip
    try:
        server.wait_ready()
        yield Fleet(server, events, work / "stats", work / "store")
    finally:
        server.stop()
        events.close()


def test_tp2_announces_a_block_once_both_ranks_stored_it(tp2_fleet: Fleet, prompts: list[list[int]]) -> None:
    """Under TP=2 each block is announced once (when both ranks' slices landed), with vLLM's hash; evicting
    a slice announces the block removed; kvdi's counters on /metrics are the sum of both ranks' stats files;
    a connector reset publishes kvdi's BlockRemoved (ownership "kvdi") beside vLLM's AllBlocksCleared."""
    a, b = prompts[0], prompts[3]
    a_blocks, b_blocks = len(a) // BLOCK_SIZE, len(b) // BLOCK_SIZE
    tp2_fleet.complete(a)
    seen = tp2_fleet.events.wait_for(lambda ev: len(_kvdi_stored(ev)) >= a_blocks)
    gpu = _gpu_blocks(seen)
    stored = _kvdi_stored(seen)
    assert len(stored) == a_blocks and len({e.block_hashes[0] for e in stored}) == a_blocks
    for i, event in enumerate(stored):
        assert gpu[event.block_hashes[0]][1] == event.token_ids == a[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
    assert len([p for p in tp2_fleet.store.rglob("*") if p.is_file()]) == 2 * a_blocks  # a slice per rank

    tp2_fleet.complete(b)
    seen = tp2_fleet.events.wait_for(lambda ev: any(type(e).__name__ == "BlockRemoved" for e in ev))
    announced = {e.block_hashes[0] for e in _kvdi_stored(seen)}
    removed = {h for e in seen if type(e).__name__ == "BlockRemoved" for h in e.block_hashes}
    assert {e.block_hashes[0] for e in stored} & removed and removed <= announced
    assert len(_kvdi_stored(seen)) <= a_blocks + b_blocks
    _assert_series_match_stats(tp2_fleet)

    before = len(tp2_fleet.events.events())
    live = _kvdi_live(tp2_fleet.events.events())
    assert tp2_fleet.server.post("/reset_prefix_cache?reset_external=true")["success"] is True
    tp2_fleet.complete(prompts[2])  # events go out with the next engine step
    seen = tp2_fleet.events.wait_for(
        lambda ev: (
            live <= _kvdi_removed(ev[before:]) and any(type(e).__name__ == "AllBlocksCleared" for e in ev[before:])
        )
    )
    assert sum(type(e).__name__ == "AllBlocksCleared" for e in seen[before:]) == 1  # vLLM's; kvdi publishes none


def test_hit_sources_by_store_and_multi_split_by_tier(tmp_path: Path) -> None:
    """vLLM's cache-hit source of each store kind; a multi hit is split by the tier that holds each block
    (no engine: kvdi's hook on real stores, with vLLM's own CacheHitSource)."""
    from types import SimpleNamespace

    from vllm.v1.metrics.cache_hit_source import CacheHitSource as Source

    from kvdi.connectors.base import KVRequest
    from kvdi.connectors.cpu_offload import HostPoolStore
    from kvdi.connectors.multi import TieredStore
    from kvdi.connectors.p2p.scheduler import P2pSchedulerConnector
    from kvdi.connectors.redis import RedisBlockStore
    from kvdi.connectors.shared_storage import FileBlockStore
    from kvdi.connectors.store.keys import block_keys
    from kvdi.integrations.vllm.fleet.events import SchedulerFleet
    from kvdi.integrations.vllm.parallel import RankSlice
    from kvdi.integrations.vllm.requests import RequestTracker
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import RedisSettings

    layout = KVCacheSpec("t", 2, 2, 8, 4, "float32")
    prompt = tuple(range(1, 22))  # 5 full blocks
    keys = block_keys(prompt, layout)
    host, disk = HostPoolStore(8, 64), FileBlockStore(tmp_path / "kv")
    host.put_many([(k, [b"x"]) for k in keys[:2]])
    disk.put_many([(k, [b"x"]) for k in keys[:4]])

    def sources(store: object, tokens: int) -> dict[Source, int]:
        half = SimpleNamespace(store=store)  # a scheduler half over ``store``, as the fleet side reads one
        fleet = SchedulerFleet(half, layout, RankSlice(), RequestTracker(), events_on=False)  # type: ignore[arg-type]
        fleet.looked_up(KVRequest("r", prompt), 0, tokens)
        return fleet.hit_sources(SimpleNamespace(request_id="r"), tokens)

    assert sources(disk, 16) == {Source.DISK: 16}
    assert sources(host, 8) == {Source.HOST: 8}
    redis_store = RedisBlockStore(RedisSettings(url="redis://127.0.0.1:1/0"))  # type: ignore[arg-type]
    assert sources(redis_store, 8) == {Source.EXTERNAL_UNSPECIFIED: 8}
    assert sources(TieredStore([("cpu_offload", host), ("shared_storage", disk)]), 16) == {
        Source.HOST: 8,
        Source.DISK: 8,
    }
    assert Source(P2pSchedulerConnector.hit_source) is Source.P2P
    assert sources(disk, 0) == {}
