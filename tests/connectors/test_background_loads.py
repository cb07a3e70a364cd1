"""Background (asynchronous) loads of the store worker half with several in flight: ``transfer.load_threads``
loads run at once, each lands whole and is reported finished receiving once, a bad object fails only its own
request's blocks from that block on, and preemption waits for the preempted request's load."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvdi.connectors.base import BlockTransfer
from kvdi.connectors.store import StoreCapabilities, StoreTransferMetadata, StoreWorkerConnector
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.keys import block_keys
from kvdi.errors import ConfigError
from kvdi.settings import load_settings
from kvdi.settings.sections import MAX_LOAD_THREADS
from kvdi.testing.redis_server import RedisServer
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
REQUESTS = 4
BLOCKS_EACH = 3
NUM_BLOCKS = 1 + REQUESTS * BLOCKS_EACH
TOKENS = list(range(REQUESTS * BLOCKS_EACH * LAYOUT.block_size + 1))
KEYS = block_keys(TOKENS, LAYOUT)


def saved(store: DictStore) -> Engine:
    """An engine that stored every block of ``TOKENS`` (blocks 1..) into ``store``; its cache is the truth."""
    source = Engine(store, LAYOUT, make_settings(), num_blocks=NUM_BLOCKS, seed=7)
    source.prefill(request(TOKENS, "source"), tuple(range(1, NUM_BLOCKS)))
    assert len(store.objects) == len(KEYS)
    return source


def transfers() -> tuple[BlockTransfer, ...]:
    """One asynchronous load per request, ``BLOCKS_EACH`` blocks each, into the same block ids the source used."""
    out = []
    for r in range(REQUESTS):
        span = slice(r * BLOCKS_EACH, (r + 1) * BLOCKS_EACH)
        out.append(BlockTransfer(f"q{r}", tuple(range(1, NUM_BLOCKS))[span], tuple(KEYS[span])))
    return tuple(out)


def run_until_received(worker: StoreWorkerConnector, loads: tuple[BlockTransfer, ...]) -> tuple[list[str], set[int]]:
    """Drive the steps vLLM drives: start the loads, then empty steps until each is reported; returns the
    requests in the order reported (with repeats, if any) and every block reported failed."""
    reported: list[str] = []
    failed: set[int] = set()
    meta = StoreTransferMetadata(async_loads=loads)
    for _ in range(1000):
        worker.bind_connector_metadata(meta)
        worker.start_load_kv()
        worker.wait_for_loads(0.05)
        _, received = worker.get_finished(set())
        failed |= worker.get_block_ids_with_load_errors()
        worker.clear_connector_metadata()
        reported += sorted(received or ())
        if len(set(reported)) == len(loads):
            worker.flush()
            _, late = worker.get_finished(set())  # nothing is reported twice, even after everything settled
            reported += sorted(late or ())
            return reported, failed
        meta = StoreTransferMetadata()
    raise AssertionError(f"loads not all reported: {reported}")


class BarrierStore(DictStore):
    """Each read waits until ``parties`` reads are inside the store at once (BrokenBarrierError otherwise)."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties, timeout=10)
        self.reading = False

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        if self.reading:
            self.barrier.wait()
        return super().get_many(keys)


def same_blocks(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], blocks: Sequence[int]) -> bool:
    return all(a[n][list(blocks)].equal(b[n][list(blocks)]) for n in a)


def test_several_loads_run_at_once_land_whole_and_are_each_reported_once() -> None:
    """With ``load_threads=2`` two requests' reads are inside the store together (a barrier of two would
    break otherwise); every block lands byte-identical and each request is finished receiving exactly once."""
    store = BarrierStore(parties=2)
    source = saved(store)
    engine = Engine(store, LAYOUT, make_settings(transfer={"load_threads": 2}), num_blocks=NUM_BLOCKS)
    engine.worker._chunk = 1  # one store call per block: every job reads several times
    store.reading = True
    reported, failed = run_until_received(engine.worker, transfers())
    assert sorted(reported) == [f"q{r}" for r in range(REQUESTS)]
    assert failed == set()
    assert same_blocks(engine.caches, source.caches, range(1, NUM_BLOCKS))
    assert engine.worker.stats.loaded_blocks == len(KEYS) and engine.worker.stats.load_failures == 0


class ThreadRecordingStore(DictStore):
    """Records the name of the thread of every read."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        self.threads.add(threading.current_thread().name)
        return super().get_many(keys)


@pytest.mark.parametrize("io_thread", [True, False])
def test_with_io_thread_a_background_load_reads_ahead_on_fetch_threads(io_thread: bool) -> None:
    """With ``io_thread`` on, a background load's next chunk is fetched on a fetch thread while its job
    checks the current one (as synchronous loads overlap); off, the job reads itself. Bytes land the same."""
    store = ThreadRecordingStore()
    source = saved(store)
    store.threads.clear()
    settings = make_settings(transfer={"load_threads": 2})
    engine = Engine(store, LAYOUT, settings, num_blocks=NUM_BLOCKS, io_thread=io_thread)
    engine.worker._chunk = 1
    reported, failed = run_until_received(engine.worker, transfers())
    assert sorted(reported) == [f"q{r}" for r in range(REQUESTS)] and failed == set()
    assert same_blocks(engine.caches, source.caches, range(1, NUM_BLOCKS))
    fetching = {name for name in store.threads if "-fetch" in name}
    assert bool(fetching) is io_thread
    assert all("-load" in name for name in store.threads - fetching)


@pytest.mark.parametrize(("threads", "io_thread"), [(1, False), (3, False), (3, True)])
def test_a_corrupt_object_fails_only_its_request_from_the_bad_block_on(threads: int, io_thread: bool) -> None:
    """A flipped byte in request q1's second block: q1's blocks from there on are load errors (counted, the
    object dropped); every other request, loaded at the same time, lands whole."""
    store = DictStore()
    source = saved(store)
    loads = transfers()
    bad = loads[1].block_keys[1]
    frame = bytearray(store.objects[bad])
    frame[-1] ^= 0xFF
    store.objects[bad] = bytes(frame)
    settings = make_settings(transfer={"load_threads": threads})
    engine = Engine(store, LAYOUT, settings, num_blocks=NUM_BLOCKS, io_thread=io_thread)
    engine.worker._chunk = 1  # the bad block is read in a chunk of its own, the next one maybe already ahead
    reported, failed = run_until_received(engine.worker, loads)
    assert sorted(reported) == [f"q{r}" for r in range(REQUESTS)]
    assert failed == set(loads[1].block_ids[1:])
    good = [b for t in loads for b in t.block_ids if b not in failed]
    assert same_blocks(engine.caches, source.caches, good)
    assert engine.worker.stats.corrupt_dropped == 1 and bad not in store.objects


class GatedReads(DictStore):
    """Reads of ``gated`` keys wait for ``gate``; ``entered`` is set when one starts, ``done`` when it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.gated: set[bytes] = set()
        self.gate, self.entered, self.done = threading.Event(), threading.Event(), threading.Event()

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        if self.gated.intersection(keys):
            self.entered.set()
            self.gate.wait(10)
            out = super().get_many(keys)
            self.done.set()
            return out
        return super().get_many(keys)


def test_preempting_a_request_waits_for_its_background_load() -> None:
    """``handle_preemptions({"q0"})`` returns only once q0's load has finished writing its blocks, while
    the other requests' loads run beside it."""
    store = GatedReads()
    source = saved(store)
    loads = transfers()
    store.gated = set(loads[0].block_keys)
    engine = Engine(store, LAYOUT, make_settings(transfer={"load_threads": 2}), num_blocks=NUM_BLOCKS)
    engine.worker.bind_connector_metadata(StoreTransferMetadata(async_loads=loads))
    engine.worker.start_load_kv()
    engine.worker.clear_connector_metadata()
    assert store.entered.wait(10)
    threading.Timer(0.1, store.gate.set).start()
    engine.worker.handle_preemptions({"q0"})
    assert store.done.is_set()  # the preempted request's read had returned before its blocks went back
    assert same_blocks(engine.caches, source.caches, loads[0].block_ids)  # and its blocks were all written
    engine.worker.flush()


@pytest.mark.parametrize("value", ["0", str(MAX_LOAD_THREADS + 1), "many"])
def test_load_threads_is_a_bounded_setting(value: str, kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVDI_TRANSFER__LOAD_THREADS`` takes 1 to ``MAX_LOAD_THREADS``; anything else names the variable."""
    monkeypatch.setenv("KVDI_TRANSFER__LOAD_THREADS", "4")
    assert load_settings().transfer.load_threads == 4
    monkeypatch.setenv("KVDI_TRANSFER__LOAD_THREADS", value)
    with pytest.raises(ConfigError, match=f"KVDI_TRANSFER__LOAD_THREADS='{value}'"):
        load_settings()


@pytest.mark.redis
def test_on_a_real_redis_server_loads_in_flight_read_into_the_cache_and_a_bad_object_fails_alone(
    redis_server: RedisServer,
) -> None:
    """The Redis store reads frames straight into the cache (``get_into_many``) from several loads at once;
    a flipped payload byte in q2's first object fails q2 from there (counted, deleted), the rest land whole."""
    redis = pytest.importorskip("redis")
    from kvdi.connectors.redis import RedisBlockStore, open_store
    from kvdi.settings import RedisSettings

    settings = make_settings(transfer={"load_threads": 3})
    store = open_store(RedisSettings.model_validate({"url": redis_server.url}), LAYOUT, settings)
    assert isinstance(store, RedisBlockStore) and StoreCapabilities.of(store).read_into
    try:
        source = Engine(store, LAYOUT, make_settings(), num_blocks=NUM_BLOCKS, seed=7)
        source.prefill(request(TOKENS, "source"), tuple(range(1, NUM_BLOCKS)))
        loads = transfers()
        bad = loads[2].block_keys[0]
        raw = redis.Redis.from_url(redis_server.url)
        raw.setrange(b"kvdi:" + bad.hex().encode(), HEADER_SIZE + 5, b"\xff")
        engine = Engine(store, LAYOUT, settings, num_blocks=NUM_BLOCKS)
        engine.worker._chunk = 2  # two objects per pipelined call
        reported, failed = run_until_received(engine.worker, loads)
        assert sorted(reported) == [f"q{r}" for r in range(REQUESTS)]
        assert failed == set(loads[2].block_ids)
        good = [b for t in loads for b in t.block_ids if b not in failed]
        assert same_blocks(engine.caches, source.caches, good)
        assert engine.worker.stats.corrupt_dropped == 1 and not raw.exists(b"kvdi:" + bad.hex().encode())
        raw.close()
    finally:
        store.close()
