"""The store halves' background I/O, step by step: queued saves, held blocks, back-pressure, the load policy,
and every store exception a counted miss."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvdi.connectors.base import BlockTransferMetadata, KVRequest, ScheduledRequest, SchedulerOutput, run_transfer_step
from kvdi.connectors.store import ASYNC_LOAD_MIN_BYTES, StoreTransferMetadata
from kvdi.connectors.store.keys import block_keys
from kvdi.errors import ConfigError
from kvdi.settings import load_settings
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))  # 4 full blocks and 2 tokens
BLOCKS = (1, 2, 3, 4, 5)
Items = Sequence[tuple[bytes, Sequence[Any]]]


class GatedStore(DictStore):
    """A DictStore whose writes wait for ``gate``; ``entered`` is set when a write starts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.entered = threading.Event(), threading.Event()
        self.calls = 0

    def put_many(self, items: Items) -> None:
        self.calls += 1
        self.entered.set()
        self.gate.wait()
        super().put_many(items)


def step(engine: Engine, req: KVRequest = PROMPT, blocks: tuple[int, ...] = BLOCKS) -> StoreTransferMetadata:
    """One prefill step of ``req`` by hand, without flushing (:meth:`Engine.step`)."""
    return engine.step(req, blocks)


def test_wait_for_save_returns_before_the_medium_and_the_blocks_stay_held_until_written() -> None:
    store = GatedStore()
    engine = Engine(store, LAYOUT, make_settings(), seed=1)
    step(engine)
    assert store.entered.wait(10) and not store.objects  # queued, not written
    assert engine.scheduler.request_finished(PROMPT, BLOCKS) == (True, None)
    assert engine.worker.get_finished({"r"}) == (None, None)  # still writing: blocks stay held
    store.gate.set()
    engine.worker.flush()
    assert engine.worker.get_finished(set()) == ({"r"}, None)
    assert len(store.objects) == 4 and engine.worker.stats.saved_blocks == 4


def test_sync_saves_are_written_before_wait_for_save_returns_and_hold_nothing() -> None:
    store = DictStore()
    engine = Engine(store, LAYOUT, make_settings(transfer={"async_save": False}), seed=1)
    step(engine)
    assert len(store.objects) == 4 and engine.worker.stats.saved_blocks == 4
    assert engine.scheduler.request_finished(PROMPT, BLOCKS) == (False, None)
    assert engine.worker.get_finished({"r"}) == (None, None)


def test_queued_saves_past_the_byte_bound_make_the_engine_wait() -> None:
    store = GatedStore()
    settings = make_settings(transfer={"max_inflight_bytes": LAYOUT.block_bytes})
    engine = Engine(store, small_layout(block_size=4, num_layers=64), settings, seed=1)  # 64 KiB blocks
    engine.worker._chunk = 1  # one block per store call, so the step's 4 saves are 4 queued writes
    done = threading.Event()
    stepping = threading.Thread(target=lambda: (step(engine), done.set()))
    stepping.start()
    assert store.entered.wait(10)
    assert not done.wait(0.2)  # one block in flight: the second must wait for the medium
    store.gate.set()
    stepping.join(10)
    assert done.is_set()
    engine.worker.flush()
    assert len(store.objects) == 4 and engine.worker._queue.backpressure_waits >= 3


@pytest.mark.parametrize("preempted", [{"r"}, None], ids=["named", "all"])
def test_preempted_requests_are_written_before_their_blocks_go_back(preempted: set[str] | None) -> None:
    store = GatedStore()
    engine = Engine(store, LAYOUT, make_settings(), seed=1)
    step(engine)
    threading.Timer(0.05, store.gate.set).start()
    engine.worker.handle_preemptions(preempted)
    assert len(store.objects) == 4 and engine.worker.stats.saved_blocks == 4


class CountingStore(DictStore):
    """Writes all but the last object of each batch and says so."""

    def put_many(self, items: Items) -> int:
        super().put_many(items[:-1])
        return len(items) - 1


@pytest.mark.parametrize("async_save", [True, False])
def test_a_partial_batch_counts_only_what_was_written(async_save: bool) -> None:
    engine = Engine(CountingStore(), LAYOUT, make_settings(transfer={"async_save": async_save}), seed=1)
    engine.prefill(PROMPT, BLOCKS)
    assert (engine.worker.stats.saved_blocks, engine.worker.stats.save_failures) == (3, 1)


class OddStore(DictStore):
    """Raises a non-OSError for one key (anywhere in a batch), like a store that got a reply of the wrong type."""

    def __init__(self, bad: bytes | None = None, lookup: bool = False, save: bool = False) -> None:
        super().__init__()
        self.bad, self.lookup, self.save = bad, lookup, save
        self.discarded: list[bytes] = []

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        if self.lookup:
            raise AttributeError("'int' object has no attribute 'decode'")
        return super().count_prefix(keys)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        if self.bad in keys:
            raise TypeError("expected bytes, got int")
        return super().get_many(keys)

    def put_many(self, items: Items) -> None:
        if self.save:
            raise OverflowError("value too large")
        super().put_many(items)

    def discard(self, key: bytes) -> None:
        self.discarded.append(key)
        raise ValueError("cannot drop either")  # a failing discard is logged, never raised


def test_an_exception_on_one_object_drops_it_and_the_blocks_before_it_still_load() -> None:
    keys = block_keys(PROMPT.prompt_token_ids, LAYOUT)
    store = OddStore()
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)
    store.bad = keys[2]
    consumer = Engine(store, LAYOUT, make_settings(transfer={"async_load": "off"}))
    assert consumer.prefill(PROMPT, (6, 7, 8, 9, 10)) == (16, {8, 9})
    assert (consumer.worker.stats.loaded_blocks, consumer.worker.stats.corrupt_dropped) == (2, 1)
    assert store.discarded == [keys[2]]


def test_an_exception_from_a_lookup_is_a_counted_miss() -> None:
    engine = Engine(OddStore(lookup=True), LAYOUT, make_settings())
    assert engine.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (0, False)
    assert engine.scheduler.stats.load_failures == 1


@pytest.mark.parametrize("async_save", [True, False])
def test_an_exception_from_a_write_is_a_counted_save_failure(async_save: bool) -> None:
    engine = Engine(OddStore(save=True), LAYOUT, make_settings(transfer={"async_save": async_save}), seed=1)
    engine.prefill(PROMPT, BLOCKS)
    assert (engine.worker.stats.saved_blocks, engine.worker.stats.save_failures) == (0, 4)


class RemoteStore(DictStore):
    prefers_async_load = True


@pytest.mark.parametrize(
    ("mode", "store", "blocks", "expected"),
    [
        ("auto", DictStore, 4, False),  # a small local hit: synchronous
        ("auto", RemoteStore, 4, True),  # the store says its reads are remote
        ("auto", DictStore, ASYNC_LOAD_MIN_BYTES // LAYOUT.block_bytes, True),  # a large hit
        ("on", DictStore, 1, True),
        ("off", RemoteStore, 10**6, False),
    ],
)
def test_load_policy(mode: str, store: type[DictStore], blocks: int, expected: bool) -> None:
    engine = Engine(store(), LAYOUT, make_settings(transfer={"async_load": mode}))
    assert engine.scheduler.load_async(blocks) is expected


def test_an_async_load_is_reported_finished_and_its_blocks_held() -> None:
    store = RemoteStore()
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)
    engine = Engine(store, LAYOUT, make_settings())
    assert engine.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (16, True)
    engine.scheduler.update_state_after_alloc(PROMPT, BLOCKS, 16)
    meta = engine.scheduler.build_connector_meta(SchedulerOutput(1, ()))  # not scheduled while it loads
    assert isinstance(meta, StoreTransferMetadata) and meta.loads == ()
    assert [t.block_ids for t in meta.async_loads] == [(1, 2, 3, 4)]
    engine.worker.bind_connector_metadata(meta)
    engine.worker.start_load_kv()
    engine.worker.flush()
    engine.worker.bind_connector_metadata(engine.scheduler.build_connector_meta(SchedulerOutput(2, ())))
    engine.worker.start_load_kv()  # the next step collects it
    assert engine.worker.get_block_ids_with_load_errors() == set()
    assert engine.worker.get_finished(set()) == (None, {"r"})
    assert engine.worker.stats.loaded_blocks == 4
    assert engine.scheduler.request_finished(PROMPT, BLOCKS) == (True, None)
    assert engine.worker.get_finished({"r"}) == ({"r"}, None)


def test_io_thread_is_a_setting(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (
        Engine(DictStore(), LAYOUT, make_settings(transfer={"io_thread": "auto"}), io_thread=None).worker.io_thread
        is None
    )
    monkeypatch.setenv("KVDI_TRANSFER__IO_THREAD", "sometimes")
    with pytest.raises(ConfigError, match="KVDI_TRANSFER__IO_THREAD='sometimes'"):
        load_settings()


def test_metadata_rewritten_by_an_adapter_saves_synchronously_and_still_reports_held_requests() -> None:
    store = DictStore()
    engine = Engine(store, LAYOUT, make_settings(), seed=1)
    n, _ = engine.scheduler.get_num_new_matched_tokens(PROMPT, 0)
    engine.scheduler.update_state_after_alloc(PROMPT, BLOCKS, n)
    meta = engine.scheduler.build_connector_meta(SchedulerOutput(1, (ScheduledRequest(PROMPT, BLOCKS, 0, 18),)))
    assert isinstance(meta, StoreTransferMetadata)
    plain = BlockTransferMetadata(meta.loads, meta.saves)  # what a block-id-translating bridge hands on
    run_transfer_step(engine.worker, plain)
    assert len(store.objects) == 4  # no background queue behind a plain metadata object
    assert engine.scheduler.request_finished(PROMPT, BLOCKS) == (True, None)
    assert engine.worker.get_finished({"r"}) == ({"r"}, None)
