"""Prefetch at lookup (``transfer.async_load=prefetch``), the store halves driven step by step as the vLLM
adapter drives them: "ask again" while the hit is fetched into host staging, the worker's report relayed to
the scheduler, then a synchronous load of exactly the staged blocks, read from staging."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvdi.connectors.base import KVRequest, ScheduledRequest, SchedulerOutput, run_transfer_step
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store import StoreTransferMetadata
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.prefetch import REPORT_GRACE_S
from kvdi.errors import ConfigError
from kvdi.settings import load_settings
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))  # 4 full blocks and 2 tokens
BLOCKS = (1, 2, 3, 4, 5)
FRAME = LAYOUT.block_bytes + HEADER_SIZE


class CountingStore(DictStore):
    """A DictStore that counts ``get_many`` calls; with ``gate`` set, reads wait for it (a slow remote store)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.gate: threading.Event | None = None
        self.fail = False

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        self.reads += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise ConnectionError("the store went away")
        return super().get_many(keys)


def _stored(store: DictStore, seed: int = 1) -> Engine:
    """A producer engine that stored PROMPT's 4 blocks in ``store``."""
    producer = Engine(store, LAYOUT, make_settings(), seed=seed)
    producer.prefill(PROMPT, BLOCKS)
    assert len(store.objects) == 4
    return producer


def _consumer(store: DictStore, **transfer: object) -> Engine:
    engine = Engine(store, LAYOUT, make_settings(transfer={"async_load": "prefetch", **transfer}), seed=2)
    assert engine.scheduler.enable_prefetch()
    return engine


def _step(
    engine: Engine, scheduled: tuple[ScheduledRequest, ...] = (), finished: frozenset[str] = frozenset()
) -> set[int]:
    """One engine step: plan, run on the worker half, relay the worker's prefetch reports to the scheduler half."""
    engine.steps += 1
    meta = engine.scheduler.build_connector_meta(SchedulerOutput(engine.steps, scheduled, finished))
    assert isinstance(meta, StoreTransferMetadata)
    errors = run_transfer_step(engine.worker, meta)
    engine.worker.flush()
    return errors


def _wait_reported(engine: Engine) -> None:
    """Idle steps until the worker's prefetch ended, its report relayed (the adapter does this per step)."""
    assert engine.worker.staging is not None
    for _ in range(100):
        engine.worker.wait_for_loads(0.1)
        reports = engine.worker.prefetch_reports()
        if reports:
            engine.scheduler.prefetched(reports)
            return
        _step(engine)
    raise AssertionError("the prefetch was never reported")


def _admit(engine: Engine, req: KVRequest = PROMPT) -> tuple[int | None, bool]:
    return engine.scheduler.get_num_new_matched_tokens(req, 0)


def test_a_hit_is_staged_first_then_loaded_from_host_memory_byte_identical() -> None:
    store = CountingStore()
    producer = _stored(store)
    consumer = _consumer(store)
    assert _admit(consumer) == (None, False)  # ask again: the hit is being fetched
    meta = consumer.scheduler.build_connector_meta(SchedulerOutput(1, ()))
    assert isinstance(meta, StoreTransferMetadata) and [len(t.block_keys) for t in meta.prefetches] == [4]
    consumer.worker.bind_connector_metadata(meta)
    assert _admit(consumer) == (None, False)  # still asking again, and the store is not asked again
    lookups = consumer.scheduler.stats.lookups
    _wait_reported(consumer)
    assert consumer.worker.staging is not None and consumer.worker.staging.held_bytes == 4 * FRAME
    store.objects.clear()  # the load must come from staging: the store no longer has the blocks
    n, load_async = _admit(consumer)
    assert (n, load_async) == (16, False) and consumer.scheduler.stats.lookups == lookups  # no second lookup
    consumer.scheduler.update_state_after_alloc(PROMPT, BLOCKS, 16)
    errors = _step(consumer, (ScheduledRequest(PROMPT, BLOCKS, 16, 2),))
    assert errors == set() and consumer.worker.stats.loaded_blocks == 4
    assert all(
        a.equal(b) for b_id in BLOCKS[:4] for a, b in zip(consumer.block(b_id), producer.block(b_id), strict=True)
    )
    assert consumer.worker.staging.held_bytes == 0 and consumer.scheduler.prefetch is not None
    assert consumer.scheduler.prefetch.reserved == 0


def test_a_hit_past_the_staging_bound_takes_the_plain_path() -> None:
    store = CountingStore()
    _stored(store)
    consumer = _consumer(store, prefetch_max_bytes=3 * FRAME)  # the 4-block hit does not fit
    n, _ = _admit(consumer)
    assert n == 16 and consumer.scheduler.prefetch is not None and consumer.scheduler.prefetch.fallbacks == 1
    consumer.scheduler.update_state_after_alloc(PROMPT, BLOCKS, 16)
    assert _step(consumer, (ScheduledRequest(PROMPT, BLOCKS, 16, 2),)) == set()
    assert consumer.worker.stats.loaded_blocks == 4


def test_a_request_aborted_while_its_prefetch_runs_frees_its_staging() -> None:
    store = CountingStore()
    _stored(store)
    consumer = _consumer(store)
    store.gate = threading.Event()  # the fetch is slow
    assert _admit(consumer) == (None, False)
    _step(consumer)  # the prefetch starts on the worker
    assert consumer.worker.staging is not None and consumer.worker.staging.requests == {"r"}
    assert consumer.scheduler.request_finished(PROMPT, []) == (False, None)  # aborted while waiting
    _step(consumer, finished=frozenset({"r"}))  # the drop reaches the worker
    store.gate.set()
    consumer.worker.staging.wait(10)
    assert consumer.worker.staging.held_bytes == 0 and not consumer.worker.staging.requests
    assert consumer.worker.prefetch_reports() == []  # a dropped prefetch is not reported
    assert consumer.scheduler.prefetch is not None and consumer.scheduler.prefetch.reserved == 0


def test_a_corrupt_staged_block_is_a_counted_miss_and_its_blocks_are_recomputed() -> None:
    store = CountingStore()
    _stored(store)
    key = sorted(store.objects, key=list(store.objects).index)[2]  # the third block
    frame = bytearray(store.objects[key])
    frame[-1] ^= 0xFF
    store.objects[key] = bytes(frame)
    consumer = _consumer(store)
    assert _admit(consumer) == (None, False)
    _step(consumer)
    _wait_reported(consumer)
    n, _ = _admit(consumer)
    consumer.scheduler.update_state_after_alloc(PROMPT, BLOCKS, n)
    errors = _step(consumer, (ScheduledRequest(PROMPT, BLOCKS, n, 2),))
    assert errors == {3, 4} and consumer.worker.stats.corrupt_dropped == 1  # from the bad block on
    assert consumer.worker.stats.loaded_blocks == 2 and key not in store.objects  # dropped from the store


def test_a_prefetch_the_store_fails_is_a_miss() -> None:
    store = CountingStore()
    _stored(store)
    consumer = _consumer(store)
    store.fail = True
    assert _admit(consumer) == (None, False)
    _step(consumer)
    _wait_reported(consumer)
    assert _admit(consumer) == (0, False)  # recomputed
    assert consumer.worker.staging is not None and consumer.worker.staging.failed == 1
    assert consumer.worker.stats.load_failures == 1  # a counted miss


def test_prefetch_without_a_host_that_relays_reports_loads_as_auto() -> None:
    store = CountingStore()
    _stored(store)
    engine = Engine(store, LAYOUT, make_settings(transfer={"async_load": "prefetch"}), seed=2)
    n, load_async = _admit(engine)  # the reference engine never calls enable_prefetch()
    assert n == 16 and load_async is False  # a small local hit: auto loads it synchronously


class SlowLookups(CountingStore):
    """A store whose lookups take 2 ms (a store across a network); with ``fail``, lookups raise."""

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        if self.fail:
            raise ConnectionError("the store went away")
        time.sleep(0.002)
        return super().count_prefix(keys)


class SaysRemote(CountingStore):
    prefers_async_load = True


@pytest.mark.parametrize(
    ("store", "fail", "prefetches"),
    [(CountingStore, False, False), (SlowLookups, False, True), (SaysRemote, False, True), (SlowLookups, True, False)],
)
def test_auto_prefetches_from_a_store_that_is_remote_by_measurement(
    store: type[CountingStore], fail: bool, prefetches: bool
) -> None:
    """``auto`` under a host that relays reports: a store whose lookup takes >= 1 ms, or that says it is remote,
    prefetches; a local one (or one whose lookups fail at start: nothing measured) keeps auto's local rules."""
    backend = store()
    _stored(backend)
    backend.fail = fail
    engine = Engine(backend, LAYOUT, make_settings(transfer={"async_load": "auto"}), seed=2)
    assert engine.scheduler.enable_prefetch() is prefetches
    backend.fail = False
    assert engine.worker.staging is not None  # the worker half is ready either way (no thread until used)
    n, load_async = _admit(engine)
    assert (n, load_async) == ((None, False) if prefetches else (16, False))
    if fail:
        assert engine.scheduler.lookup_s is None
    elif store is not SaysRemote:
        assert engine.scheduler.lookup_s is not None and (engine.scheduler.lookup_s >= 0.001) is prefetches


@pytest.mark.parametrize("value", ["0", "-1", "lots"])
def test_prefetch_max_bytes_is_bounded(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_TRANSFER__PREFETCH_MAX_BYTES", value)
    with pytest.raises(ConfigError, match="KVDI_TRANSFER__PREFETCH_MAX_BYTES"):
        load_settings()


class Wedged:
    """A real store (shared_storage in a temp folder) behind a double that answers ``get_many`` with junk (an
    entry that is no buffer) or never returns until released: the two ways a store wedged prefetch (issue 28)."""

    def __init__(self, inner: FileBlockStore, mode: str) -> None:
        self.inner = inner
        self.mode = mode
        self.release = threading.Event()

    def get_many(self, keys: Sequence[bytes]) -> list[Any]:
        if self.mode == "junk":
            return [object() for _ in keys]
        if self.mode == "hang":
            self.release.wait(30)
        return self.inner.get_many(keys)

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        return self.inner.count_prefix(keys)

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Any]]]) -> int:
        return self.inner.put_many(items)

    def discard(self, key: bytes) -> None:
        self.inner.discard(key)

    def close(self) -> None:
        self.release.set()
        self.inner.close()


@pytest.fixture
def wedged(tmp_path: Path) -> Iterator[Callable[[str], Wedged]]:
    made: list[Wedged] = []

    def make(mode: str) -> Wedged:
        store = Wedged(FileBlockStore(tmp_path / "kv"), "plain")
        Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)  # type: ignore[arg-type]
        store.mode = mode
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def test_a_store_answering_junk_to_a_prefetch_is_a_reported_miss(wedged: Callable[[str], Wedged]) -> None:
    """``get_many`` returns entries that are no buffers: the prefetch is reported (0 staged, a counted load
    failure), the request computes, its staging is freed when it ends; nothing waits forever."""
    store = wedged("junk")
    consumer = Engine(store, LAYOUT, make_settings(transfer={"async_load": "prefetch"}), seed=2)  # type: ignore[arg-type]
    assert consumer.scheduler.enable_prefetch()
    assert _admit(consumer) == (None, False)
    _step(consumer)
    _wait_reported(consumer)
    assert _admit(consumer) == (0, False)  # recomputed
    assert consumer.worker.staging is not None and consumer.worker.staging.failed == 1
    assert consumer.worker.stats.load_failures == 1
    consumer.scheduler.request_finished(PROMPT, [])
    _step(consumer, finished=frozenset({"r"}))
    assert consumer.worker.staging.held_bytes == 0 and consumer.scheduler.prefetch is not None
    assert consumer.scheduler.prefetch.reserved == 0


def test_a_store_call_that_never_returns_ends_at_the_prefetch_deadline(wedged: Callable[[str], Wedged]) -> None:
    """``get_many`` hangs: past ``prefetch_timeout_s`` the worker reports a miss and releases the staging; the
    request computes. The fetch that returns later stages nothing."""
    store = wedged("hang")
    settings = make_settings(transfer={"async_load": "prefetch", "prefetch_timeout_s": 0.2})
    consumer = Engine(store, LAYOUT, settings, seed=2)  # type: ignore[arg-type]
    assert consumer.scheduler.enable_prefetch()
    assert _admit(consumer) == (None, False)
    _step(consumer)
    _wait_reported(consumer)
    staging = consumer.worker.staging
    assert staging is not None and staging.timed_out == 1 and staging.held_bytes == 0 and not staging.requests
    assert _admit(consumer) == (0, False) and consumer.worker.stats.load_failures == 1
    store.release.set()
    staging.wait(5)
    assert staging.held_bytes == 0 and consumer.worker.prefetch_reports() == []


def test_a_prefetch_whose_report_never_comes_takes_the_plain_path(wedged: Callable[[str], Wedged]) -> None:
    """A scheduler whose worker never reports (a lost report, a wedged worker) stops asking again after the
    deadline and a grace second: the lookup takes the plain path and the reservation is released."""
    store = wedged("plain")
    settings = make_settings(transfer={"async_load": "prefetch", "prefetch_timeout_s": 0.1})
    consumer = Engine(store, LAYOUT, settings, seed=2)  # type: ignore[arg-type]
    assert consumer.scheduler.enable_prefetch()
    assert _admit(consumer) == (None, False)
    planner = consumer.scheduler.prefetch
    assert planner is not None and planner.reserved > 0
    time.sleep(0.1 + REPORT_GRACE_S + 0.1)  # the reports are never relayed
    n, _ = _admit(consumer)
    assert n == 16 and planner.overdue == 1 and planner.reserved == 0


@pytest.mark.parametrize("value", ["0", "-1", "601", "soon"])
def test_prefetch_timeout_s_is_bounded(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVDI_TRANSFER__PREFETCH_TIMEOUT_S", value)
    with pytest.raises(ConfigError, match="KVDI_TRANSFER__PREFETCH_TIMEOUT_S"):
        load_settings()
