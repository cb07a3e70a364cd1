"""Frames are bound to their names: an object copied under another block's name is a counted miss.

The attack: anyone who can write the store (no integrity key needed) copies prompt Q's
objects to prompt P's names (or tenant B's to tenant A's, or one rank's slice to another
rank's name). Each frame names the block key it was written for, and the checksum and the
MAC cover that name, so the victim's engine drops the copy (``corrupt_dropped``) and
recomputes, with or without ``KVDI_INTEGRITY_KEY``. Real files and a real redis-server.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvdi.connectors.base import (
    ConnectorContext,
    KVConnectorRole,
    KVRequest,
    ScheduledRequest,
    SchedulerOutput,
    run_transfer_step,
)
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store import BlockStore, StoreSchedulerConnector, StoreWorkerConnector
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.keys import block_keys
from kvdi.integrations.vllm.parallel import AllRanksStore, RankSlice
from kvdi.testing.redis_server import RedisServer
from tests.helpers.store import Engine, make_caches, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
FRAME = HEADER_SIZE + LAYOUT.block_bytes
SECRET = "correct horse battery staple"
IDS = (1, 2, 3, 4, 5)
VICTIM = request(range(18), "p")  # four full blocks
OTHER = request(range(100, 118), "q")  # prompt Q: four full blocks of other tokens

Copy = Callable[[bytes, bytes], None]


@dataclass
class Medium:
    store: BlockStore
    copy: Copy  # copy the object named by the first key to the name of the second, behind the store's back


@pytest.fixture(params=["files", "redis"])
def medium(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Medium]:
    if request.param == "files":
        store = FileBlockStore(tmp_path / "kv", object_bytes=FRAME)

        def copy_file(src: bytes, dst: bytes) -> None:
            target = store.path_for(dst)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(store.path_for(src), target)

        yield Medium(store, copy_file)
        store.close()
        return
    redis = pytest.importorskip("redis")
    from kvdi.connectors.redis import RedisBlockStore
    from kvdi.settings import RedisSettings

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    with RedisServer() as server:
        rstore = RedisBlockStore(RedisSettings(url=server.url, op_timeout_s=2.0))
        raw = redis.Redis.from_url(server.url)

        def copy_key(src: bytes, dst: bytes) -> None:
            (name,) = raw.keys(b"*" + src.hex().encode())  # the store's own key naming, prefix and all
            raw.set(name[: -2 * len(src)] + dst.hex().encode(), raw.get(name))

        yield Medium(rstore, copy_key)
        raw.close()
        rstore.close()


def settings(keyed: bool) -> dict[str, object]:
    return {"integrity_key": SECRET} if keyed else {}


def assert_copy_is_a_counted_miss(engine: Engine, req: KVRequest, store: BlockStore, keys: list[bytes]) -> None:
    n, errors = engine.prefill(req, IDS)
    assert n == 16  # the copies look like hits to a lookup ...
    assert errors == {1, 2, 3, 4}  # ... but not one of them is loaded: the engine recomputes them all
    stats = engine.worker.stats
    assert (stats.loaded_blocks, stats.corrupt_dropped) == (0, 1)
    assert store.count_prefix(keys) == 0  # the copy was dropped from the store


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "key"])
def test_another_prompts_objects_under_this_prompts_names_are_misses(medium: Medium, keyed: bool) -> None:
    Engine(medium.store, LAYOUT, make_settings(**settings(keyed)), seed=1).prefill(OTHER, IDS)
    victim_keys, other_keys = block_keys(VICTIM.prompt_token_ids, LAYOUT), block_keys(OTHER.prompt_token_ids, LAYOUT)
    for src, dst in zip(other_keys, victim_keys, strict=True):
        medium.copy(src, dst)
    engine = Engine(medium.store, LAYOUT, make_settings(**settings(keyed)))
    assert_copy_is_a_counted_miss(engine, VICTIM, medium.store, victim_keys)


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "key"])
def test_another_tenants_objects_under_this_tenants_names_are_misses(medium: Medium, keyed: bool) -> None:
    tenant_b = request(VICTIM.prompt_token_ids, "b", salt="tenant-b")
    tenant_a = request(VICTIM.prompt_token_ids, "a", salt="tenant-a")
    Engine(medium.store, LAYOUT, make_settings(**settings(keyed)), seed=1).prefill(tenant_b, IDS)
    a_keys = block_keys(tenant_a.prompt_token_ids, LAYOUT, "tenant-a")
    for src, dst in zip(block_keys(tenant_b.prompt_token_ids, LAYOUT, "tenant-b"), a_keys, strict=True):
        medium.copy(src, dst)
    engine = Engine(medium.store, LAYOUT, make_settings(**settings(keyed)))
    assert_copy_is_a_counted_miss(engine, tenant_a, medium.store, a_keys)


@dataclass
class RankEngine(Engine):
    """One TP rank of a two-rank engine whose ranks share a layout fingerprint: the scheduler looks a block
    up on every rank's slice (as the vLLM adapter does), the worker moves this rank's slice under its key."""

    shape: RankSlice = field(default_factory=RankSlice)

    def __post_init__(self) -> None:
        def ctx(role: KVConnectorRole, store: object) -> ConnectorContext:
            return ConnectorContext("test_store", role, self.settings, self.layout, None, store)

        self.scheduler = StoreSchedulerConnector(ctx(KVConnectorRole.SCHEDULER, AllRanksStore(self.store, self.shape)))
        self.worker = StoreWorkerConnector(ctx(KVConnectorRole.WORKER, self.store))
        self.worker.io_thread = False
        self.caches = make_caches(self.layout, self.num_blocks, self.seed)
        self.worker.register_kv_caches(self.caches)

    def prefill(self, request: KVRequest, block_ids: tuple[int, ...]) -> tuple[int, set[int]]:
        n, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        self.scheduler.update_state_after_alloc(request, block_ids, n)
        sched = ScheduledRequest(request, block_ids, n, len(request.prompt_token_ids) - n)
        self.steps += 1
        meta = self.shape.rekey(self.scheduler.build_connector_meta(SchedulerOutput(self.steps, (sched,))))
        errors = run_transfer_step(self.worker, meta)
        self.worker.flush()
        self.scheduler.request_finished(request, block_ids)
        return n, errors


def rank_engine(store: BlockStore, rank: int, keyed: bool, seed: int | None = None) -> RankEngine:
    return RankEngine(store, LAYOUT, make_settings(**settings(keyed)), seed=seed, shape=RankSlice(2, 1, rank, 0))


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "key"])
def test_one_ranks_slices_under_another_ranks_names_are_misses(medium: Medium, keyed: bool) -> None:
    rank0, rank1 = RankSlice(2, 1, 0, 0), RankSlice(2, 1, 1, 0)
    keys = block_keys(VICTIM.prompt_token_ids, LAYOUT)
    rank_engine(medium.store, 0, keyed, seed=1).prefill(VICTIM, IDS)  # only rank 0 stored its slices
    for key in keys:
        medium.copy(rank0.key(key), rank1.key(key))  # rank 0's slice stands in for rank 1's
    victim = rank_engine(medium.store, 1, keyed)
    assert_copy_is_a_counted_miss(victim, VICTIM, medium.store, [rank1.key(k) for k in keys])


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "key"])
def test_objects_stored_under_their_own_names_still_load(medium: Medium, keyed: bool) -> None:
    """The control: the same engines, nothing copied, every block loads."""
    producer = Engine(medium.store, LAYOUT, make_settings(**settings(keyed)), seed=1)
    producer.prefill(VICTIM, IDS)
    consumer = Engine(medium.store, LAYOUT, make_settings(**settings(keyed)))
    assert consumer.prefill(VICTIM, (6, 7, 8, 9, 10)) == (16, set())
    assert consumer.worker.stats.loaded_blocks == 4
    for a, b in zip(producer.block(1), consumer.block(6), strict=True):
        assert a.equal(b)
