"""A conformance suite for :class:`~kvdi.connectors.store.BlockStore` backends: one fixture, every store.

Inherit :class:`BlockStoreConformance` in a test class and give it one fixture,
``open_block_store``: a callable ``open(frame_bytes, max_objects=None) -> BlockStore`` that
opens a fresh, empty store for objects of ``frame_bytes`` bytes (``max_objects``: a cap the
store should evict down to; stores without eviction set ``evicts = False`` on the class)::

    import pytest
    from kvdi.testing.conformance import BlockStoreConformance

    class TestMyStore(BlockStoreConformance):
        evicts = False

        @pytest.fixture
        def open_block_store(self, tmp_path):
            opened = []
            def open_(frame_bytes, max_objects=None):
                opened.append(MyStore(tmp_path / "kv"))
                return opened[-1]
            yield open_
            for store in opened:
                store.close()

The checks drive the store through kvdi's real store halves (the scheduler half's lookups,
the worker half's framing and verification) over a real CPU cache, and call the store
directly where the contract is the store's own: round trip, missing objects, corrupt and
hostile objects (what a writer with access to the store can put there), concurrent writers
and readers, eviction, bounded reads and the optional capabilities it declares
(:class:`~kvdi.connectors.store.StoreCapabilities`). Hostile *files* (symlinks, FIFOs) are
specific to a medium; test those next to your store.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, Protocol

import pytest

from kvdi.connectors.base import (
    ConnectorContext,
    KVConnectorRole,
    KVRequest,
    ScheduledRequest,
    SchedulerOutput,
    run_transfer_step,
)
from kvdi.connectors.store import (
    BlockStore,
    StoreCapabilities,
    StoreSchedulerConnector,
    StoreWorkerConnector,
    written_count,
)
from kvdi.connectors.store.framing import HEADER_SIZE, frame_header
from kvdi.connectors.store.keys import block_keys
from kvdi.connectors.store.protocol import HIT_SOURCES
from kvdi.layout import KVCacheSpec
from kvdi.settings import KvdiSettings

if TYPE_CHECKING:
    import torch

LAYOUT = KVCacheSpec("kvdi-conformance", 2, 2, 8, 4, "float32")
FRAME_BYTES = HEADER_SIZE + LAYOUT.block_bytes
PROMPT = KVRequest("conformance", tuple(range(1000, 1018)))  # 18 tokens: 4 whole blocks of 4, offered 16
KEYS = block_keys(PROMPT.prompt_token_ids, LAYOUT)
BLOCKS = (1, 2, 3, 4, 5)
READ_SLACK = 1024  # a store may return a little more than a frame (e.g. a MAC trailer), never much more


class OpenStore(Protocol):
    def __call__(self, frame_bytes: int, max_objects: int | None = None) -> BlockStore: ...


class Halves:
    """Both store halves of one engine over ``store``, with a real CPU cache; one whole prompt per step."""

    def __init__(self, store: BlockStore, seed: int | None = None, num_blocks: int = 16) -> None:
        import torch

        settings = KvdiSettings(
            kv_role="kv_both", engine_id="conformance", transfer={"async_save": False, "async_load": "off"}
        )

        def context(role: KVConnectorRole) -> ConnectorContext:
            return ConnectorContext("conformance", role, settings, LAYOUT, None, store)

        self.scheduler = StoreSchedulerConnector(context(KVConnectorRole.SCHEDULER))
        self.worker = StoreWorkerConnector(context(KVConnectorRole.WORKER))
        shape = (num_blocks, *LAYOUT.block_shape)
        gen = torch.Generator().manual_seed(seed or 0)
        self.caches = {
            n: torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape) for n in LAYOUT.layer_names
        }
        self.worker.register_kv_caches(self.caches)
        self._steps = 0

    def prefill(self, request: KVRequest = PROMPT, block_ids: tuple[int, ...] = BLOCKS) -> tuple[int, set[int]]:
        """Look up, load and save one prompt; returns (tokens offered, block ids whose load failed)."""
        matched, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        n = matched or 0  # None ("ask again") only after a host turned prefetch on; these halves never do
        self.scheduler.update_state_after_alloc(request, block_ids, n)
        self._steps += 1
        scheduled = ScheduledRequest(request, block_ids, n, len(request.prompt_token_ids) - n)
        errors = run_transfer_step(
            self.worker, self.scheduler.build_connector_meta(SchedulerOutput(self._steps, (scheduled,)))
        )
        self.worker.flush()
        self.scheduler.request_finished(request, block_ids)
        return n, errors

    def block(self, block_id: int) -> list[torch.Tensor]:
        return [c[block_id].clone() for c in self.caches.values()]


def frame(seed: int, layout: KVCacheSpec = LAYOUT, name: bytes = bytes(16)) -> bytes:
    """A valid frame of ``layout`` for block key ``name`` with a payload drawn from ``seed``."""
    payload = random.Random(seed).randbytes(layout.block_bytes)
    return frame_header(layout.fingerprint(), payload, name=name) + payload


def object_size(obj: object) -> int:
    return memoryview(obj).nbytes  # type: ignore[arg-type]


def hostile_objects() -> dict[str, bytes]:
    """What a writer with access to the store can put under a key, none of it a valid frame for LAYOUT."""
    good = frame(7)
    flipped = bytearray(good)
    flipped[HEADER_SIZE + 5] ^= 0x10
    other = KVCacheSpec("another-model", 2, 2, 8, 4, "float32")
    return {
        "empty": b"",
        "one byte": b"\x00",
        "random bytes": random.Random(1).randbytes(300),
        "header only": good[:HEADER_SIZE],
        "truncated": good[:-1],
        "trailing byte": good + b"\x00",
        "flipped payload bit": bytes(flipped),
        "flipped header byte": bytes([good[0] ^ 1]) + good[1:],
        "other layout": frame(7, other),
    }


class BlockStoreConformance:
    """The checks every BlockStore passes; subclasses provide the ``open_block_store`` fixture."""

    evicts: ClassVar[bool] = True
    """Whether the store honours ``max_objects`` (evicts least recently used objects to stay under it)."""

    @pytest.fixture
    def store(self, open_block_store: OpenStore) -> BlockStore:
        made = open_block_store(FRAME_BYTES)
        assert isinstance(made, BlockStore), f"{type(made).__name__} lacks a BlockStore method"
        return made

    # -- round trip -----------------------------------------------------------------------------

    def test_round_trip_through_the_halves_restores_every_byte(self, store: BlockStore) -> None:
        producer = Halves(store, seed=1)
        assert producer.prefill() == (0, set())
        consumer = Halves(store)
        assert consumer.prefill(block_ids=(6, 7, 8, 9, 10)) == (16, set())
        for stored, loaded in zip(range(1, 5), range(6, 10), strict=True):
            assert all(a.equal(b) for a, b in zip(producer.block(stored), consumer.block(loaded), strict=True))
        assert consumer.worker.stats.loaded_blocks == 4 and consumer.worker.stats.corrupt_dropped == 0

    def test_put_then_get_returns_the_same_bytes(self, store: BlockStore) -> None:
        objects = [frame(i) for i in range(4)]
        pieces = [(key, [obj[:HEADER_SIZE], obj[HEADER_SIZE:]]) for key, obj in zip(KEYS, objects, strict=True)]
        assert written_count(store.put_many(pieces), 4) == 4
        assert store.count_prefix(KEYS) == 4
        assert [bytes(o) if o is not None else None for o in store.get_many(KEYS)] == objects

    def test_an_object_written_twice_holds_the_second_version(self, store: BlockStore) -> None:
        store.put_many([(KEYS[0], [frame(1)])])
        store.put_many([(KEYS[0], [frame(2)])])
        got = store.get_many([KEYS[0]])[0]
        assert got is not None and bytes(got) == frame(2)

    # -- missing --------------------------------------------------------------------------------

    def test_missing_keys_are_none_and_count_prefix_stops_at_the_first_gap(self, store: BlockStore) -> None:
        assert store.count_prefix(KEYS) == 0
        assert store.get_many(KEYS) == [None] * len(KEYS)
        store.put_many([(KEYS[0], [frame(0)]), (KEYS[2], [frame(2)])])
        assert store.count_prefix(KEYS) == 1
        assert store.get_many([KEYS[1]]) == [None]
        assert store.count_prefix([]) == 0 and store.get_many([]) == []

    def test_discard_removes_an_object_and_ignores_absent_keys(self, store: BlockStore) -> None:
        store.put_many([(KEYS[0], [frame(0)])])
        store.discard(KEYS[0])
        store.discard(KEYS[1])
        assert store.count_prefix(KEYS) == 0 and store.get_many([KEYS[0]]) == [None]

    def test_a_block_gone_before_its_load_is_a_load_failure_from_there_on(self, store: BlockStore) -> None:
        Halves(store, seed=1).prefill()
        consumer = Halves(store)
        n, _ = consumer.scheduler.get_num_new_matched_tokens(PROMPT, 0)
        assert n == 16
        store.discard(KEYS[2])  # evicted between lookup and load
        consumer.scheduler.update_state_after_alloc(PROMPT, BLOCKS, n)
        meta = consumer.scheduler.build_connector_meta(SchedulerOutput(1, (ScheduledRequest(PROMPT, BLOCKS, n, 2),)))
        assert run_transfer_step(consumer.worker, meta) == {3, 4}
        assert consumer.worker.stats.load_failures == 1 and consumer.worker.stats.loaded_blocks == 2

    # -- corrupt and hostile objects -------------------------------------------------------------

    @pytest.mark.parametrize("kind", sorted(hostile_objects()))
    def test_a_hostile_object_is_a_miss_never_an_exception(self, store: BlockStore, kind: str) -> None:
        """No hostile byte reaches the cache: blocks load only up to it (or all, if the store refused to keep it)."""
        producer = Halves(store, seed=1)
        producer.prefill()
        store.put_many([(KEYS[1], [hostile_objects()[kind]])])
        consumer = Halves(store)
        n, errors = consumer.prefill(block_ids=(6, 7, 8, 9, 10))
        loaded = n // LAYOUT.block_size - len(errors)
        assert loaded >= 1, f"{kind}: block 0 is genuine and must load"
        for stored, into in zip(range(1, 1 + loaded), range(6, 6 + loaded), strict=True):
            assert all(a.equal(b) for a, b in zip(producer.block(stored), consumer.block(into), strict=True)), kind
        stats = consumer.worker.stats
        if loaded < n // LAYOUT.block_size:  # the bad object was read: counted once and dropped
            assert loaded == 1 and stats.corrupt_dropped + stats.load_failures == 1
            assert store.count_prefix(KEYS) == 1

    def test_reads_are_bounded_to_about_one_frame(self, store: BlockStore) -> None:
        huge = frame(3) * 16
        store.put_many([(KEYS[0], [huge])])
        got = store.get_many([KEYS[0]])[0]
        assert got is None or object_size(got) <= FRAME_BYTES + READ_SLACK
        assert Halves(store).prefill() in ((0, set()), (4, {1}))  # absent, or offered and dropped

    # -- concurrency ----------------------------------------------------------------------------

    def test_concurrent_writers_and_readers_see_whole_objects(self, store: BlockStore) -> None:
        versions = {w: [frame(100 * w + i) for i in range(len(KEYS))] for w in range(3)}
        valid = {i: {v[i] for v in versions.values()} for i in range(len(KEYS))}
        torn: list[str] = []
        stop = threading.Event()

        def write(w: int) -> None:
            for _ in range(10):
                store.put_many(
                    [(k, [o[:HEADER_SIZE], o[HEADER_SIZE:]]) for k, o in zip(KEYS, versions[w], strict=True)]
                )

        def read() -> None:
            while not stop.is_set():
                for i, obj in enumerate(store.get_many(KEYS)):
                    if obj is not None and bytes(obj) not in valid[i]:
                        torn.append(f"key {i}: {object_size(obj)} B")

        readers = [threading.Thread(target=read) for _ in range(2)]
        writers = [threading.Thread(target=write, args=(w,)) for w in versions]
        for t in readers + writers:
            t.start()
        for t in writers:
            t.join()
        stop.set()
        for t in readers:
            t.join()
        assert not torn, torn[:3]
        final = store.get_many(KEYS)
        assert all(o is not None and bytes(o) in valid[i] for i, o in enumerate(final))

    def test_two_engines_saving_the_same_prefix_leave_it_loadable(self, store: BlockStore) -> None:
        engines = [Halves(store, seed=1), Halves(store, seed=1)]
        run_threads([e.prefill for e in engines])
        assert Halves(store).prefill(block_ids=(6, 7, 8, 9, 10)) == (16, set())

    # -- eviction -------------------------------------------------------------------------------

    def test_a_capped_store_stays_under_its_cap_and_keeps_the_newest_chain(self, open_block_store: OpenStore) -> None:
        if not self.evicts:
            pytest.skip("this store does not evict (evicts = False)")
        store = open_block_store(FRAME_BYTES, 8)
        chains = [KVRequest(f"r{r}", tuple(range(r * 100, r * 100 + 18))) for r in range(5)]
        for r, request in enumerate(chains):
            Halves(store, seed=r).prefill(request)
        held = sum(store.count_prefix([k]) for c in chains for k in block_keys(c.prompt_token_ids, LAYOUT))
        assert 0 < held <= 8
        assert store.count_prefix(block_keys(chains[-1].prompt_token_ids, LAYOUT)) == 4
        assert Halves(store).prefill(chains[-1], (6, 7, 8, 9, 10)) == (16, set())

    # -- declared capabilities ------------------------------------------------------------------

    def test_declared_hit_source_and_parts_are_what_vllm_and_the_adapter_take(self, store: BlockStore) -> None:
        """``hit_source`` (declared or not) is one of vLLM's cache-hit sources; a composite's parts are stores."""
        caps = StoreCapabilities.of(store)
        assert caps.hit_source in HIT_SOURCES, f"hit_source {caps.hit_source!r} is not one of {HIT_SOURCES}"
        assert isinstance(caps.prefers_async_load, bool)
        for part in caps.parts:
            assert isinstance(part, BlockStore) and part is not store

    def test_an_eviction_watch_names_every_object_the_store_dropped(self, open_block_store: OpenStore) -> None:
        """With ``watch_evictions``: every object written is either still held or was named to the watcher."""
        store = open_block_store(FRAME_BYTES, 8)
        watch = StoreCapabilities.of(store).watch_evictions
        if watch is None or not self.evicts:
            pytest.skip("this store declares no eviction watch (watch_evictions)")
        evicted: list[bytes] = []
        watch(evicted.append)
        chains = [KVRequest(f"r{r}", tuple(range(r * 100, r * 100 + 18))) for r in range(5)]
        for r, request in enumerate(chains):
            Halves(store, seed=r).prefill(request)
        written = {k for c in chains for k in block_keys(c.prompt_token_ids, LAYOUT)}
        held = {k for k in written if store.count_prefix([k])}
        assert evicted and not held & set(evicted), "a key named evicted is still held"
        assert written == held | set(evicted), "an object went away without being named to the watcher"

    def test_health_names_each_node_with_whether_it_serves(self, store: BlockStore) -> None:
        """With ``health()``: node label -> True while it serves (a healthy store after a round trip)."""
        health = StoreCapabilities.of(store).health
        if health is None:
            pytest.skip("this store declares no health()")
        Halves(store, seed=1).prefill()
        states = dict(health())
        assert states and all(isinstance(k, str) and v is True for k, v in states.items()), states

    def test_declared_capabilities_behave(self, store: BlockStore) -> None:
        caps = StoreCapabilities.of(store)
        if caps.num_slots is not None:
            assert caps.num_slots >= 1
        if caps.check is not None:
            assert isinstance(caps.check(), str) and caps.check()
        if not caps.read_into:
            return
        objects = [frame(i) for i in range(2)]
        store.put_many([(k, [o]) for k, o in zip(KEYS, objects, strict=False)])
        targets = [[memoryview(bytearray(HEADER_SIZE)), memoryview(bytearray(LAYOUT.block_bytes))] for _ in range(3)]
        short = [memoryview(bytearray(8))]
        sizes = store.get_into_many([(KEYS[0], targets[0]), (KEYS[1], targets[1]), (KEYS[2], targets[2])])  # type: ignore[attr-defined]
        assert sizes == [FRAME_BYTES, FRAME_BYTES, None]
        assert [b"".join(bytes(p) for p in t) for t in targets[:2]] == objects
        assert store.get_into_many([(KEYS[0], short)]) == [FRAME_BYTES]  # type: ignore[attr-defined]
        assert bytes(short[0]) == bytes(8)  # a size mismatch leaves the pieces untouched


def run_threads(fns: Sequence[Callable[[], object]]) -> None:
    threads = [threading.Thread(target=f) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


__all__ = ["FRAME_BYTES", "LAYOUT", "BlockStoreConformance", "Halves", "OpenStore", "frame", "hostile_objects"]
