"""The p2p connector halves over real processes on loopback (gloo), and the producer's held blocks.

Each pair test spawns a producer and a consumer process that build real KVTransferContainers
(``kv_connector="p2p"``), drive the connector halves by hand on random CPU caches, and report
through a queue. Every wait is bounded and every process is killed if it overruns.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from queue import Empty
from typing import Any

import pytest
import torch

from kvdi.connectors.base import KVRequest, ScheduledRequest, SchedulerConnector, SchedulerOutput, WorkerConnector
from kvdi.connectors.p2p.frames import CacheReceiver, LayerSink, gather_frames
from kvdi.connectors.p2p.held import Frames, HeldBlocks
from kvdi.connectors.store.framing import HEADER_SIZE, CorruptObjectError, unframe

TIMEOUT_S = 3.0
WAIT_S = 60.0
PROMPT = KVRequest("req-1", tuple(range(13)))  # block size 4: 3 loadable blocks, the 13th token is computed
PRODUCER_BLOCKS = (5, 6, 7, 8)
CONSUMER_BLOCKS = (1, 2, 3, 4)
LOADED = 3
FOREIGN_CONNECT_S = 15.0


# -- processes ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def p2p_settings(role: str, port: int, block_size: int = 4, connect_timeout_s: float = 60.0) -> Any:
    from kvdi.settings import load_settings

    p2p = {"kv_port": port, "kv_rank": 0 if role == "kv_producer" else 1, "timeout_s": TIMEOUT_S}
    return load_settings(
        kv_connector="p2p",
        kv_role=role,
        p2p=p2p | {"connect_timeout_s": connect_timeout_s},
        model={"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "hidden_size": 32},
        allocator={"device": "cpu", "num_blocks": 16, "block_size": block_size},
        transfer={"async_load": "off"},  # these tests drive one synchronous step by hand
    )


def random_caches(layout: Any, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn((16, *layout.block_shape), generator=gen) for n in layout.layer_names}


def halves(container: Any) -> tuple[SchedulerConnector, WorkerConnector]:
    sched, worker = container.scheduler_connector(), container.worker_connector()
    assert isinstance(sched, SchedulerConnector) and isinstance(worker, WorkerConnector)
    return sched, worker


def one_step(request: KVRequest, blocks: tuple[int, ...], computed: int) -> SchedulerOutput:
    scheduled = ScheduledRequest(request, blocks, computed, len(request.prompt_token_ids) - computed)
    return SchedulerOutput(1, (scheduled,))


def poll_until(ready: Callable[[], bool], timeout_s: float) -> None:
    """Poll instead of Event.wait: a process killed inside Event.wait leaves the Event unusable for set()."""
    deadline = time.monotonic() + timeout_s
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.02)


def producer(port: int, out: Any, events: dict[str, Any], block_size: int, connect_timeout_s: float) -> None:
    """Hold PROMPT's blocks, say so, then report the held count once the consumer is done."""
    from kvdi.containers import build_kv_container

    try:
        container = build_kv_container(p2p_settings("kv_producer", port, block_size, connect_timeout_s))
        sched, worker = halves(container)
        worker.register_kv_caches(random_caches(container.layout(), seed=1))
        sched.update_state_after_alloc(PROMPT, PRODUCER_BLOCKS, sched.get_num_new_matched_tokens(PROMPT, 0)[0])
        worker.bind_connector_metadata(sched.build_connector_meta(one_step(PROMPT, PRODUCER_BLOCKS, 0)))
        worker.wait_for_save()
        worker.clear_connector_metadata()
        channel = container.backend()
        out.put(("held", len(channel.held)))
        events["published"].set()
        poll_until(events["consumer_done"].is_set, WAIT_S)
        deadline = time.monotonic() + TIMEOUT_S
        while len(channel.held) and time.monotonic() < deadline:
            time.sleep(0.01)
        out.put(("held_after", len(channel.held)))
        container.shutdown_resources()
    except Exception as exc:
        out.put(("producer_error", (type(exc).__name__, str(exc))))


def consumer(port: int, out: Any, events: dict[str, Any], block_size: int) -> None:
    """Look PROMPT up, optionally let the parent freeze the producer, load, and report what arrived."""
    from kvdi.containers import build_kv_container

    try:
        container = build_kv_container(p2p_settings("kv_consumer", port, block_size))
        sched, worker = halves(container)
        caches = random_caches(container.layout(), seed=2)
        worker.register_kv_caches(caches)
        events["published"].wait(WAIT_S)
        matched, _ = sched.get_num_new_matched_tokens(PROMPT, 0)
        out.put(("matched", matched))
        events["looked_up"].set()
        events["go"].wait(WAIT_S)
        sched.update_state_after_alloc(PROMPT, CONSUMER_BLOCKS, matched)
        worker.bind_connector_metadata(sched.build_connector_meta(one_step(PROMPT, CONSUMER_BLOCKS, matched)))
        start = time.monotonic()
        worker.start_load_kv()
        errors = sorted(worker.get_block_ids_with_load_errors())
        elapsed = time.monotonic() - start
        worker.clear_connector_metadata()
        expected = random_caches(container.layout(), seed=1)
        same = all(
            torch.equal(caches[n][list(CONSUMER_BLOCKS[:LOADED])], expected[n][list(PRODUCER_BLOCKS[:LOADED])])
            for n in caches
        )
        again = sched.get_num_new_matched_tokens(KVRequest("req-2", PROMPT.prompt_token_ids), 0)[0]
        out.put(("loaded", {"errors": errors, "same": same, "elapsed": elapsed, "again": again}))
        events["consumer_done"].set()
        container.shutdown_resources()
    except Exception as exc:
        out.put(("consumer_error", (type(exc).__name__, str(exc))))


class Pair:
    """A producer and a consumer process plus their reports; every wait is bounded."""

    def __init__(self, consumer_block_size: int = 4) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.out: Any = ctx.Queue()
        self.events = {k: ctx.Event() for k in ("published", "looked_up", "go", "consumer_done")}
        # a foreign consumer is refused and the producer waits for a valid one until its connect timeout
        connect_s = 60.0 if consumer_block_size == 4 else FOREIGN_CONNECT_S
        self.producer = ctx.Process(target=producer, args=(port, self.out, self.events, 4, connect_s), daemon=True)
        self.consumer = ctx.Process(
            target=consumer, args=(port, self.out, self.events, consumer_block_size), daemon=True
        )
        self.reports: dict[str, Any] = {}

    def report(self, key: str, timeout_s: float = WAIT_S) -> Any:
        """The value reported under ``key``; fails on a child's error or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while key not in self.reports:
            try:
                k, v = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
            except Empty:
                pytest.fail(f"no {key!r} report within {timeout_s}s (got {sorted(self.reports)})")
            self.reports[k] = v
            if k.endswith("_error") and not key.endswith("_error"):
                pytest.fail(f"{k}: {v}")
        return self.reports[key]

    def errors(self) -> dict[str, tuple[str, str]]:
        """Both processes' errors (for tests where both must fail)."""
        return {k: self.report(k) for k in ("producer_error", "consumer_error")}


@contextmanager
def pair(consumer_block_size: int = 4) -> Iterator[Pair]:
    p = Pair(consumer_block_size)
    p.producer.start()
    p.consumer.start()
    try:
        yield p
    finally:
        for proc in (p.consumer, p.producer):
            proc.join(WAIT_S if proc.exitcode is None and proc.is_alive() else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


@pytest.fixture(autouse=True)
def _isolated_env(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No KVDI_* of the developer reaches the child processes, and no OpenMP spinning on a shared machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# -- over processes ----------------------------------------------------------------------
def test_consumer_loads_the_producers_blocks_and_the_producer_frees_them() -> None:
    with pair() as p:
        assert p.report("held") == LOADED
        assert p.report("matched") == LOADED * 4
        p.events["go"].set()
        loaded = p.report("loaded")
        assert loaded["errors"] == [] and loaded["same"]
        assert p.report("held_after") == 0  # confirmed by the consumer: nothing left held


def test_foreign_layout_is_refused_at_the_handshake_naming_both_layouts() -> None:
    with pair(consumer_block_size=8) as p:
        errors = p.errors()
    for kind, message in errors.values():
        assert kind == "P2pHandshakeError"
        assert "foreign KV layout" in message and "block_size=4" in message and "block_size=8" in message
    assert "found no valid consumer" in errors["producer_error"][1]  # it waited for another one first


def test_frozen_producer_fails_the_load_within_the_timeout_and_the_blocks_are_reported() -> None:
    with pair() as p:
        assert p.report("matched") == LOADED * 4
        assert p.events["looked_up"].wait(WAIT_S)
        os.kill(p.producer.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        try:
            p.events["go"].set()
            loaded = p.report("loaded", timeout_s=TIMEOUT_S + 30)
        finally:
            p.producer.kill()
    assert loaded["errors"] == list(CONSUMER_BLOCKS[:LOADED])
    assert loaded["elapsed"] < TIMEOUT_S + 5.0  # bounded by KVDI_P2P__TIMEOUT_S, never a hang
    assert loaded["again"] == 0  # a broken channel offers nothing more


def test_dead_producer_fails_the_load_and_the_blocks_are_reported() -> None:
    with pair() as p:
        assert p.report("matched") == LOADED * 4
        assert p.events["looked_up"].wait(WAIT_S)
        p.producer.kill()
        p.producer.join(10)
        p.events["go"].set()
        loaded = p.report("loaded", timeout_s=TIMEOUT_S + 30)
    assert loaded["errors"] == list(CONSUMER_BLOCKS[:LOADED])
    assert loaded["elapsed"] < TIMEOUT_S + 5.0


# -- held blocks (one process) -----------------------------------------------------------
LAYER_BYTES = 8


def frames(n: int, fill: int = 0) -> Frames:
    """``n`` fake framed blocks of two layers (the contents only need to be recognisable)."""
    layers = torch.arange(2 * n * LAYER_BYTES, dtype=torch.int64).add(fill).remainder(251).to(torch.uint8)
    headers = torch.full((n * HEADER_SIZE,), fill, dtype=torch.uint8)
    return Frames(layers.view(2, n * LAYER_BYTES), headers)


def same(a: Frames | None, b: Frames) -> bool:
    return a is not None and torch.equal(a.layers, b.layers) and torch.equal(a.headers, b.headers)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_held_lookup_returns_views_when_the_found_blocks_are_consecutive() -> None:
    held = HeldBlocks(10.0, 1 << 20)
    saved = frames(3)
    assert held.hold([b"a", b"b", b"c"], saved) == ([b"a", b"b", b"c"], [])
    found, got = held.lookup([b"b", b"c"])
    assert found == [True, True] and same(got, saved.block_range(1, 3))
    assert got is not None and got.layers.data_ptr() == saved.layers[:, LAYER_BYTES:].data_ptr()


def test_held_lookup_gathers_blocks_of_several_saves_in_request_order() -> None:
    held = HeldBlocks(10.0, 1 << 20)
    one, two = frames(1, 1), frames(1, 2)
    held.hold([b"x"], one)
    held.hold([b"y"], two)
    found, got = held.lookup([b"y", b"missing", b"x"])
    assert found == [True, False, True]
    assert same(got, Frames(torch.cat([two.layers, one.layers], dim=1), torch.cat([two.headers, one.headers])))


def test_held_block_is_freed_after_as_many_releases_as_holds() -> None:
    held = HeldBlocks(10.0, 1 << 20)
    held.hold([b"a"], frames(1))
    assert held.hold([b"a"], frames(1)) == ([], [])  # already published
    assert held.release([b"a", b"a"]) == []  # one consumer takes it once
    assert held.release([b"a"]) == [b"a"]
    assert len(held) == 0 and held.nbytes == 0


def test_held_blocks_expire_after_hold_s() -> None:
    clock = Clock()
    held = HeldBlocks(5.0, 1 << 20, clock=clock)
    held.hold([b"a", b"b"], frames(2))
    clock.now = 4.9
    assert held.expire() == []
    clock.now = 5.0
    assert sorted(held.expire()) == [b"a", b"b"]
    assert len(held) == 0 and held.nbytes == 0


def test_held_bytes_cap_evicts_the_oldest_save() -> None:
    size = frames(1).nbytes
    held = HeldBlocks(10.0, 2 * size)
    held.hold([b"old"], frames(1))
    held.hold([b"mid"], frames(1))
    assert held.hold([b"new"], frames(1)) == ([b"new"], [b"old"])
    assert held.nbytes == 2 * size
    assert held.hold([b"h1", b"h2", b"h3"], frames(3)) == ([], [])  # larger than the cap: not held


# -- cache <-> wire layout (one process) ---------------------------------------------------
def small_layout() -> Any:
    from kvdi.layout import KVCacheSpec

    return KVCacheSpec("kvdi-test", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def block_names(ids: list[int]) -> list[bytes]:
    """The block keys the frames of blocks ``ids`` are made for (and asked for) in these tests."""
    return [bytes([i]) * 16 for i in ids]


def receive_locally(frames_: Frames, receiver: CacheReceiver, targets: list[int], sent: list[int]) -> LayerSink:
    """What the channel does with each layer message, without the network (``sent``: the source block ids)."""
    buffers, direct = receiver.buffers(targets)
    sink = receiver.receiving(buffers, targets, direct, block_names(sent))
    for layer, buf in enumerate(buffers):
        buf.copy_(frames_.layers[layer])
        sink(layer, 0, 1)  # in two parts, as the channel may deliver them
        sink(layer, 1, len(targets))
    return sink


@pytest.mark.parametrize("targets", [[1, 2, 3], [3, 1, 2]], ids=["straight-into-cache", "staged"])
def test_blocks_arrive_in_the_consumer_cache_intact(targets: list[int]) -> None:
    layout = small_layout()
    source, dest = random_caches(layout, seed=1), random_caches(layout, seed=2)
    names = list(layout.layer_names)
    sent = gather_frames([source[n] for n in names], [5, 6, 7], layout, names=block_names([5, 6, 7]))
    receiver = CacheReceiver([dest[n] for n in names], layout, torch.device("cpu"))
    sink = receive_locally(sent, receiver, targets, [5, 6, 7])
    assert sink.direct == (targets == [1, 2, 3])
    assert sink.verdicts(sent.headers) == [None, None, None]
    for n in names:
        assert torch.equal(dest[n][targets], source[n][[5, 6, 7]])


def test_a_wire_block_is_the_frame_every_store_holds() -> None:
    layout = small_layout()
    caches = random_caches(layout, seed=1)
    sent = gather_frames([caches[n] for n in layout.layer_names], [4], layout, names=block_names([4]))
    frame = sent.headers.numpy().tobytes() + b"".join(sent.layers[i].numpy().tobytes() for i in range(2))
    payload = unframe(frame, layout.fingerprint(), layout.block_bytes, name=block_names([4])[0])
    assert bytes(payload) == b"".join(caches[n][4].numpy().tobytes() for n in layout.layer_names)


def test_a_corrupted_byte_fails_only_its_block() -> None:
    layout = small_layout()
    source, dest = random_caches(layout, seed=1), random_caches(layout, seed=2)
    names = list(layout.layer_names)
    sent = gather_frames([source[n] for n in names], [5, 6, 7], layout, names=block_names([5, 6, 7]))
    sent.layers[1, layout.layer_block_bytes + 3] ^= 0xFF  # block 1, layer 1
    receiver = CacheReceiver([dest[n] for n in names], layout, torch.device("cpu"))
    verdicts = receive_locally(sent, receiver, [1, 2, 3], [5, 6, 7]).verdicts(sent.headers)
    assert verdicts[0] is None and verdicts[2] is None
    assert isinstance(verdicts[1], CorruptObjectError) and verdicts[1].reason == "checksum"


@pytest.mark.parametrize(
    ("sender", "reader", "problem"),
    [("k" * 32, "k" * 32, None), (None, "k" * 32, "mac"), ("o" * 32, "k" * 32, "mac"), (None, None, None)],
    ids=["same-key", "unkeyed-sender", "other-key", "no-key"],
)
def test_a_keyed_reader_accepts_only_frames_maced_under_its_key(
    sender: str | None, reader: str | None, problem: str | None
) -> None:
    from kvdi.connectors.store.framing import FrameKey

    layout = small_layout()
    source, dest = random_caches(layout, seed=1), random_caches(layout, seed=2)
    names = list(layout.layer_names)
    sent = gather_frames(
        [source[n] for n in names],
        [5, 6],
        layout,
        FrameKey(sender.encode()) if sender else None,
        names=block_names([5, 6]),
    )
    key = FrameKey(reader.encode()) if reader else None
    receiver = CacheReceiver([dest[n] for n in names], layout, torch.device("cpu"), key=key)
    verdicts = receive_locally(sent, receiver, [1, 2], [5, 6]).verdicts(sent.headers)
    assert [v.reason if v else None for v in verdicts] == [problem, problem]


def test_the_receivers_staging_comes_from_the_allocator_one_buffer_per_layer() -> None:
    from kvdi.allocator import StagingBuffers

    layout = small_layout()
    source, dest = random_caches(layout, seed=1), random_caches(layout, seed=2)
    names = list(layout.layer_names)
    staging = StagingBuffers(pin_memory=False)
    receiver = CacheReceiver([dest[n] for n in names], layout, torch.device("cpu"), staging)
    sent = gather_frames([source[n] for n in names], [5, 6, 7], layout, names=block_names([5, 6, 7]))
    assert (
        receive_locally(sent, receiver, [1, 2, 3], [5, 6, 7]).direct and staging.nbytes == {}
    )  # straight into the cache
    sink = receive_locally(sent, receiver, [3, 1, 2], [5, 6, 7])
    assert not sink.direct and sink.verdicts(sent.headers) == [None, None, None]
    assert staging.nbytes == {"cpu": 2 * 3 * layout.layer_block_bytes}  # two layers, three blocks each
    assert all(b.data_ptr() == s.data_ptr() for b, s in zip(staging.buffers, sink.buffers, strict=True))
    for n in names:
        assert torch.equal(dest[n][[3, 1, 2]], source[n][[5, 6, 7]])
