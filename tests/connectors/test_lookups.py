"""Lookups off the scheduler's path (``scheduler.lookup=async``): a real Redis behind kvdi's latency proxy, the
store halves driven step by step as the vLLM adapter drives them. The first ask answers "ask again" while the
server holds the reply (frozen: SIGSTOP), the next ask after the background lookup returns the hit; a failed or
timed-out lookup is a counted miss; an ended request's lookup is dropped; entries stay bounded."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kvdi.connectors.base import ScheduledRequest, SchedulerOutput, run_transfer_step
from kvdi.connectors.store.lookups import AsyncLookups
from kvdi.errors import ConfigError
from kvdi.settings import RedisSettings, load_settings
from kvdi.testing.latency_proxy import LatencyProxy
from kvdi.testing.redis_server import RedisServer
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

pytest.importorskip("redis")
from kvdi.connectors.redis import RedisBlockStore

pytestmark = pytest.mark.redis

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))  # 4 full blocks and 2 tokens: 4 blocks stored, 4 loadable
BLOCKS = (1, 2, 3, 4, 5)


def redis_store(url: str, **options: object) -> RedisBlockStore:
    fields: dict[str, object] = {"url": url, "connect_timeout_s": 2.0, "op_timeout_s": 10.0, **options}
    return RedisBlockStore(RedisSettings.model_validate(fields))


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[LatencyProxy]:
    """Redis 5 ms away (each way), with PROMPT's 4 blocks stored by a producer talking to it directly."""
    store = redis_store(redis_server.url)
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)
    assert store.count_prefix(Engine(store, LAYOUT, make_settings()).scheduler._plan(PROMPT).keys) == 4
    store.close()
    with LatencyProxy(("127.0.0.1", redis_server.port), delay_ms=5) as p:
        yield p


def consumer(url: str, lookup: str = "async", **scheduler: object) -> Engine:
    settings = make_settings(scheduler={"lookup": lookup, **scheduler}, transfer={"async_load": "off"})
    engine = Engine(redis_store(url), LAYOUT, settings, seed=2)
    engine.scheduler.enable_lookups()
    return engine


def step(engine: Engine, *scheduled: ScheduledRequest) -> SchedulerOutput:
    engine.steps += 1
    return SchedulerOutput(engine.steps, scheduled)


def answered(engine: Engine) -> None:
    """Wait (a bound, not a figure) until the background lookups are answered."""
    lookups = engine.scheduler.lookups
    assert lookups is not None
    deadline = time.monotonic() + 10
    while lookups.pending and time.monotonic() < deadline:
        lookups.wait(0.5)
    assert lookups.pending == 0


def test_the_first_ask_returns_while_the_server_holds_the_reply_and_a_later_one_the_hit(
    redis_server: RedisServer, proxy: LatencyProxy
) -> None:
    """Server frozen: the ask answers None at once (a synchronous lookup would wait); once thawed and answered, the
    next ask offers the 4 stored blocks, which load exactly as the producer computed them."""
    engine = consumer(proxy.url("redis"))
    sched = engine.scheduler
    assert sched.lookups is not None and sched.lookups.batched  # Redis answers a step's lookups in one pipeline
    redis_server.freeze()
    try:
        assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
        sched.build_connector_meta(step(engine))  # the step ends: its lookups leave for the store
        assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)  # still held: ask again
        assert sched.lookups.pending == 1
    finally:
        redis_server.thaw()
    answered(engine)
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (16, False)
    sched.update_state_after_alloc(PROMPT, BLOCKS, 16)
    meta = sched.build_connector_meta(step(engine, ScheduledRequest(PROMPT, BLOCKS, 16, 2)))
    assert [t.block_ids for t in meta.loads] == [BLOCKS[:4]]
    assert run_transfer_step(engine.worker, meta) == set()
    producer = Engine(redis_store(redis_server.url), LAYOUT, make_settings(), seed=1)
    producer.prefill(request(range(18), rid="again"), BLOCKS)  # recomputes the same blocks from the same seed
    for block in BLOCKS[:4]:
        for mine, theirs in zip(engine.block(block), producer.block(block), strict=True):
            assert torch.equal(mine, theirs)
    assert sched.stats.lookups == 1 and sched.stats.load_failures == 0


def test_a_steps_lookups_travel_in_one_round_trip(proxy: LatencyProxy) -> None:
    """Eight requests asked in one step: one background store call answers them all."""
    engine = consumer(proxy.url("redis"))
    prompts = [request(range(18), rid=f"r{i}") for i in range(4)] + [
        request(range(100 + i, 118 + i), rid=f"miss{i}") for i in range(4)
    ]
    assert all(engine.scheduler.get_num_new_matched_tokens(p, 0) == (None, False) for p in prompts)
    engine.scheduler.build_connector_meta(step(engine))
    answered(engine)
    assert engine.scheduler.lookups is not None and engine.scheduler.lookups.counters.batches == 1
    answers = [engine.scheduler.get_num_new_matched_tokens(p, 0)[0] for p in prompts]
    assert answers == [16] * 4 + [0] * 4


def test_a_failed_lookup_is_a_counted_miss(redis_server: RedisServer, proxy: LatencyProxy) -> None:
    """The store goes away while the lookup waits: the next ask is a miss (0 tokens), counted once."""
    engine = consumer(proxy.url("redis"))
    sched = engine.scheduler
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
    redis_server.kill()
    sched.build_connector_meta(step(engine))
    answered(engine)
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)  # the answer stands, counted once
    assert sched.stats.load_failures == 1
    assert sched.lookups is not None and sched.lookups.counters.failed == 1


def test_a_lookup_past_its_timeout_is_a_counted_miss(redis_server: RedisServer, proxy: LatencyProxy) -> None:
    """A server that never answers: past ``scheduler.lookup_timeout_s`` the ask is a miss, never a wait."""
    engine = consumer(proxy.url("redis"), lookup_timeout_s=0.05)
    sched = engine.scheduler
    redis_server.freeze()
    try:
        assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
        sched.build_connector_meta(step(engine))
        time.sleep(0.1)
        assert sched.get_num_new_matched_tokens(PROMPT, 0) == (0, False)
    finally:
        redis_server.thaw()
    assert sched.stats.load_failures == 1
    assert sched.lookups is not None and sched.lookups.counters.timed_out == 1


def test_an_aborted_requests_lookup_is_dropped(redis_server: RedisServer, proxy: LatencyProxy) -> None:
    """A request that ends while its lookup runs leaves nothing behind, even when the reply comes later."""
    engine = consumer(proxy.url("redis"))
    sched = engine.scheduler
    lookups = sched.lookups
    assert lookups is not None
    redis_server.freeze()
    try:
        assert sched.get_num_new_matched_tokens(PROMPT, 0) == (None, False)
        sched.build_connector_meta(step(engine))
        assert sched.request_finished(PROMPT, []) == (False, None)
        assert len(lookups) == 0 and lookups.counters.dropped == 1
    finally:
        redis_server.thaw()
    deadline = time.monotonic() + 10
    while lookups.counters.batches == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lookups.counters.batches == 1 and len(lookups) == 0 and lookups.counters.answered == 0


def test_entries_stay_bounded_and_answers_expire() -> None:
    """At most ``max_entries`` lookups at once (answered ones make room); an answer past its TTL asks again."""
    store = DictStore()
    lookups = AsyncLookups(store, "t", max_entries=4, ttl_s=0.05)
    keys = [bytes([i]) * 16 for i in range(6)]
    assert [lookups.answer(f"r{i}", 0, [k]) for i, k in enumerate(keys)] == [None] * 6
    assert len(lookups) == 4 and lookups.counters.full == 2
    lookups.flush()
    deadline = time.monotonic() + 10
    while lookups.pending and time.monotonic() < deadline:
        lookups.wait(0.5)
    assert lookups.answer("r4", 0, [keys[4]]) is None  # answered entries make room, oldest first
    assert len(lookups) == 4
    answer = lookups.answer("r3", 0, [keys[3]])
    assert answer is not None and answer.answer == 0 and answer.failure is None
    time.sleep(0.06)
    assert lookups.answer("r3", 0, [keys[3]]) is None and lookups.counters.expired == 1
    lookups.shutdown()


def test_redis_counts_many_prefixes_in_one_call(redis_server: RedisServer, proxy: LatencyProxy) -> None:
    """``count_prefix_many`` answers as ``count_prefix`` does, list by list."""
    store = redis_store(proxy.url("redis"))
    keys = Engine(store, LAYOUT, make_settings()).scheduler._plan(PROMPT).keys
    lists = [keys, keys[1:], [b"x" * 32, *keys], [], keys[:2]]
    assert store.count_prefix_many(lists) == [store.count_prefix(k) for k in lists] == [4, 3, 0, 0, 2]


@pytest.mark.parametrize("value", ["fast", "", "ASYNC"])
def test_a_bad_lookup_setting_names_the_variable_and_the_choices(value: str) -> None:
    with pytest.raises(ConfigError, match=r"scheduler.lookup must be auto, sync or async, got"):
        load_settings(scheduler={"lookup": value})


class SaysRemote(DictStore):
    prefers_async_load = True


class SlowLookups(DictStore):
    def count_prefix(self, keys: list[bytes]) -> int:  # type: ignore[override]
        time.sleep(0.002)  # a store across a network (2 ms a round trip)
        return super().count_prefix(keys)


@pytest.mark.parametrize(
    ("setting", "store", "unavailable", "on", "says"),
    [
        ("auto", DictStore, None, False, "inside the scheduler's step (sync: auto, store lookup "),
        ("auto", SlowLookups, None, True, "in the background, batched per step (async: auto, store lookup "),
        ("auto", SaysRemote, None, True, "(async: auto, a store that says it is remote)"),
        ("async", DictStore, None, True, "(async: scheduler.lookup=async)"),
        ("sync", SaysRemote, None, False, "(sync: scheduler.lookup=sync)"),
        ("async", SaysRemote, "an in-process key index", False, "(sync: an in-process key index)"),
    ],
)
def test_the_lookup_way_is_decided_once_per_store_and_said(
    setting: str, store: type[DictStore], unavailable: str | None, on: bool, says: str
) -> None:
    """``scheduler.lookup``: auto measures the store as ``async_load=auto`` does (1 ms or more: background)."""
    engine = Engine(store(), LAYOUT, make_settings(scheduler={"lookup": setting}))
    assert engine.scheduler.enable_lookups(unavailable) is on
    assert (engine.scheduler.lookups is not None) is on
    assert says in engine.scheduler.load_policy.describe_lookup()


def test_without_a_host_that_asks_again_lookups_stay_in_the_step() -> None:
    """The reference engine never enables them: even ``lookup=async`` answers at once."""
    engine = Engine(SaysRemote(), LAYOUT, make_settings(scheduler={"lookup": "async"}))
    assert engine.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (0, False)
