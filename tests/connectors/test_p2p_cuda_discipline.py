"""The CPU-side half of the p2p connector's CUDA paths (issue 22), without a GPU.

- the consumer worker's copies: a background load's side stream waits for the compute queued when
  the load was handed over, the job waits for its copies before the request is reported, and
  staging is reused only after the previous fetch's copies out of it ran (recorded with
  :class:`~kvdi.testing.cuda_recording.RecordingCuda`; the channel is a test double that serves
  real frames);
- a failed fetch drains its posted receives (the process group is aborted, nothing lands late);
- NCCL waits are bounded on the host, its errors break the channel instead of the process, and the
  communicator is created at pairing (recorded with a stand-in for ``ProcessGroupNCCL``).
The same paths on a GPU are in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch

from kvdi.connectors.base import BlockTransfer, ConnectorContext, KVConnectorRole
from kvdi.connectors.p2p import groups
from kvdi.connectors.p2p.channel import Answer, P2pChannel
from kvdi.connectors.p2p.errors import P2pTransferError
from kvdi.connectors.p2p.frames import gather_frames
from kvdi.connectors.p2p.scheduler import P2pTransferMetadata
from kvdi.connectors.p2p.worker import P2pWorkerConnector
from kvdi.connectors.streams import StreamOrder
from kvdi.layout import KVCacheSpec
from kvdi.settings import load_settings
from kvdi.testing.cuda_recording import RecordingCuda

LAYOUT = KVCacheSpec("m", 2, 2, 8, 4, "float32")
BLOCKS = 16


# -- the consumer worker's copies ------------------------------------------------------------------
class ServingChannel(P2pChannel):
    """A consumer channel double: answers every fetch with real frames of ``source`` (no network)."""

    def __init__(self, source: list[torch.Tensor]) -> None:  # no pairing: nothing to connect to
        self.producer = False
        self.source = source
        self.layer_bytes = LAYOUT.layer_block_bytes
        self._broken = None
        self.fetches = 0
        self._frames: Any = None

    @property
    def wire_device(self) -> torch.device:
        return torch.device("cpu")

    def request(self, keys: Sequence[bytes]) -> Answer:
        self.fetches += 1
        ids = [int.from_bytes(k[:1], "big") for k in keys]  # the test's keys name the source block
        self._frames = gather_frames(self.source, ids, LAYOUT, names=list(keys))
        return Answer(self.fetches, (True,) * len(keys), self._frames.headers, time.monotonic() + 5)

    def receive(
        self, answer: Answer, buffers: Sequence[torch.Tensor], on_part: Callable[[int, int, int], None]
    ) -> None:
        for layer, buffer in enumerate(buffers):
            buffer.copy_(self._frames.layers[layer])
            on_part(layer, 0, answer.count)

    def finish(self, answer: Answer) -> None:
        pass


def consumer(
    source: list[torch.Tensor], max_staging_bytes: int = 1 << 20
) -> tuple[P2pWorkerConnector, list[torch.Tensor], RecordingCuda]:
    allocator = {"device": "cpu", "max_staging_bytes": max_staging_bytes}
    settings = load_settings(kv_connector="p2p", kv_role="kv_consumer", p2p={"kv_rank": 1}, allocator=allocator)
    context = ConnectorContext("p2p", KVConnectorRole.WORKER, settings, LAYOUT, settings.p2p, ServingChannel(source))
    worker = P2pWorkerConnector(context)
    cuda = RecordingCuda()
    worker._order = StreamOrder("cuda:0", cuda)  # the cache is on "CUDA": its copies are recorded
    caches = [torch.zeros((BLOCKS, *LAYOUT.block_shape)) for _ in LAYOUT.layer_names]
    worker.register_kv_caches(dict(zip(LAYOUT.layer_names, caches, strict=True)))
    worker._receiver.direct_ok = False  # type: ignore[union-attr]  # a CUDA cache behind a gloo wire: staged
    return worker, caches, cuda


def source_caches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(22)
    return [torch.randn((BLOCKS, *LAYOUT.block_shape), generator=gen) for _ in LAYOUT.layer_names]


def transfer(request_id: str, targets: tuple[int, ...], sources: tuple[int, ...]) -> BlockTransfer:
    return BlockTransfer(request_id, targets, tuple(bytes([s]) * 16 for s in sources))


def test_an_async_load_runs_after_the_handover_fence_and_settles_before_it_is_reported() -> None:
    source = source_caches()
    worker, caches, cuda = consumer(source)
    worker.bind_connector_metadata(P2pTransferMetadata(async_loads=(transfer("r", (3, 7), (1, 2)),)))
    worker.start_load_kv()
    worker.flush()
    assert cuda.log[0] == ("record", "e1", "compute")  # engine thread, at hand-over
    assert cuda.log[1] == ("wait_event", "side1", "e1")  # before anything of the job
    assert cuda.log[-2:] == [("record", "e3", "side1"), ("host_wait", "e3", "side1")]  # before the report
    worker.clear_connector_metadata()
    worker.bind_connector_metadata(P2pTransferMetadata())
    worker.start_load_kv()
    assert worker.get_finished(set()) == (None, {"r"})
    assert all(torch.equal(c[[3, 7]], s[[1, 2]]) for c, s in zip(caches, source, strict=True))


def test_staging_is_reused_only_after_the_previous_fetchs_copies_out_of_it_ran() -> None:
    source = source_caches()
    worker, caches, cuda = consumer(source)
    for step, (targets, sources) in enumerate((((2, 9), (4, 5)), ((11, 4), (6, 8)))):
        worker.bind_connector_metadata(P2pTransferMetadata(loads=(transfer(f"s{step}", targets, sources),)))
        worker.start_load_kv()
        worker.clear_connector_metadata()
    # first fetch: an event after its copies (engine stream); the second waits on it before receiving
    assert cuda.log == [("record", "e1", "compute"), ("host_wait", "e1", "compute"), ("record", "e2", "compute")]
    assert all(torch.equal(c[[2, 9, 11, 4]], s[[4, 5, 6, 8]]) for c, s in zip(caches, source, strict=True))


# -- draining a failed fetch ---------------------------------------------------------------------------
class Work:
    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.waits = 0

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits += 1
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        return True


class Group:
    def __init__(self, failing_part: int) -> None:
        self.posted = 0
        self.failing_part = failing_part
        self.aborted = False
        self.works: list[Work] = []

    def recv(self, tensors: list[torch.Tensor], rank: int, tag: int) -> Work:
        self.posted += 1
        self.works.append(Work(fails=self.posted == self.failing_part))
        return self.works[-1]

    def abort(self) -> None:
        self.aborted = True


def receiving_channel(group: Group) -> P2pChannel:
    channel = P2pChannel.__new__(P2pChannel)  # the receive path only, over a recorded process group
    settings = load_settings(kv_connector="p2p", kv_role="kv_consumer", p2p={"kv_rank": 1, "timeout_s": 2.0})
    channel.options, channel.layout, channel.backend = settings.p2p, LAYOUT, "gloo"
    channel.layer_bytes, channel._pg, channel._broken = LAYOUT.layer_block_bytes, group, None
    return channel


def test_a_failed_receive_aborts_the_group_so_posted_receives_never_land_and_breaks_the_channel() -> None:
    group = Group(failing_part=2)
    channel = receiving_channel(group)
    arrived: list[tuple[int, int, int]] = []
    buffers = [torch.zeros(2 * LAYOUT.layer_block_bytes, dtype=torch.uint8) for _ in range(LAYOUT.num_layers)]
    answer = Answer(1, (True, True), torch.zeros(0, dtype=torch.uint8), time.monotonic() + 2)
    with pytest.raises(P2pTransferError, match="Connection closed"):
        channel.receive(answer, buffers, lambda *part: arrived.append(part))
    assert group.posted == LAYOUT.num_layers  # every part was posted before the first wait
    assert group.aborted and channel.broken is not None
    assert arrived == [(0, 0, 2)]  # nothing after the failure was handed on


def test_a_receive_that_fails_on_its_first_part_settles_every_part_posted_after_it() -> None:
    """gloo's group abort() is a no-op: each receive still posted is waited for (it lands now or its
    timeout closes the pair) before the failure is raised, so none lands later."""
    group = Group(failing_part=1)
    channel = receiving_channel(group)
    buffers = [torch.zeros(2 * LAYOUT.layer_block_bytes, dtype=torch.uint8) for _ in range(LAYOUT.num_layers)]
    answer = Answer(1, (True, True), torch.zeros(0, dtype=torch.uint8), time.monotonic() + 2)
    with pytest.raises(P2pTransferError, match="Connection closed"):
        channel.receive(answer, buffers, lambda *part: None)
    assert [w.waits for w in group.works] == [1] * LAYOUT.num_layers  # each once: the failed one, then the rest


def test_closing_a_channel_aborts_its_nccl_group_instead_of_dropping_it() -> None:
    """close() releases the communicator (abort: it never waits on a peer that may be gone); a gloo
    group, whose abort() does nothing, is simply dropped."""
    from kvdi.connectors.p2p.held import HeldBlocks

    for backend, aborted in (("nccl", True), ("gloo", False)):
        group = Group(failing_part=0)
        channel = receiving_channel(group)
        channel.backend, channel._server, channel.held = backend, None, HeldBlocks(1.0, 1 << 20)
        channel.close()
        assert (group.aborted, channel._pg, channel.broken) == (aborted, None, "closed")


# -- NCCL ------------------------------------------------------------------------------------------
class NcclWork:
    def __init__(self, done_after: float = 0.0, error: Exception | None = None) -> None:
        self.done_at = time.monotonic() + done_after
        self.error = error
        self.waited = 0

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def exception(self) -> Exception | None:
        return self.error

    def wait(self, timeout: timedelta | None = None) -> bool:
        assert timeout is None and self.is_completed()  # only to order the stream, never to block
        self.waited += 1
        return True


def test_an_nccl_wait_is_bounded_on_the_host() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        groups.wait_work(NcclWork(done_after=60.0), time.monotonic() + 0.2, "nccl")
    assert time.monotonic() - start < 2.0


def test_an_nccl_error_is_raised_for_the_channel_to_break_on() -> None:
    with pytest.raises(RuntimeError, match="process group failed"):
        groups.wait_work(NcclWork(error=RuntimeError("NCCL communicator was aborted")), time.monotonic() + 1, "nccl")


def test_a_completed_nccl_operation_orders_the_stream_after_it() -> None:
    work = NcclWork(done_after=0.01)
    groups.wait_work(work, time.monotonic() + 2, "nccl")
    assert work.waited == 1


def test_the_nccl_group_cleans_up_only_on_errors_and_connects_at_pairing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constructed with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (the user's value restored after), and one
    warm-up message exchanged before the channel is handed over."""
    seen: dict[str, Any] = {}

    class FakeNccl:
        class Options:
            _timeout: timedelta

        def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
            seen["handling"] = os.environ.get(groups.NCCL_ERROR_HANDLING)
            seen["timeout"] = options._timeout

        def send(self, tensors: list[torch.Tensor], rank: int, tag: int) -> NcclWork:
            seen["warm_up"] = (rank, tag)
            return NcclWork()

    monkeypatch.setenv(groups.NCCL_ERROR_HANDLING, "3")
    monkeypatch.setattr(groups.dist, "ProcessGroupNCCL", FakeNccl, raising=False)  # absent from CPU builds
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.setdefault("device", device))
    group = groups.make_group(
        "nccl", None, 0, timeout=timedelta(seconds=7), device=torch.device("cpu"), host="127.0.0.1",
        deadline=time.monotonic() + 5,
    )  # fmt: skip
    assert isinstance(group, FakeNccl)
    assert seen["handling"] == groups.CLEAN_UP_ONLY and os.environ[groups.NCCL_ERROR_HANDLING] == "3"
    assert seen["timeout"] == timedelta(seconds=7) and seen["warm_up"] == (1, groups.WARM_UP_TAG)


class SendingGroup:
    """A producer's process group double: records how many bytes of sends are in flight at once."""

    def __init__(self) -> None:
        self.in_flight: list[NcclWork] = []
        self.sizes: dict[int, int] = {}
        self.most = 0

    def send(self, tensors: list[torch.Tensor], rank: int, tag: int) -> Any:
        group = self

        class SendWork(NcclWork):
            def wait(self, timeout: timedelta | None = None) -> bool:
                group.in_flight.remove(self)
                return super().wait(timeout)

        work = SendWork()
        self.sizes[id(work)] = tensors[0].numel()
        self.in_flight.append(work)
        self.most = max(self.most, sum(self.sizes[id(w)] for w in self.in_flight))
        return work


class OwnStore:
    def clone(self) -> OwnStore:
        return self


def test_the_producer_copies_at_most_its_staging_budget_of_an_answer_to_the_device_at_once() -> None:
    """Over NCCL each part of an answer is copied to the device: the serving thread waits for sent parts
    before it copies more than ``wire_budget`` bytes, however many blocks the consumer asked for."""
    from kvdi.connectors.p2p.held import HeldBlocks
    from kvdi.connectors.p2p.protocol import Request, Session
    from kvdi.connectors.p2p.serving import Server

    source = source_caches()
    names = [bytes([i]) * 16 for i in range(8)]
    held = HeldBlocks(60.0, 1 << 24)
    held.hold(names, gather_frames(source, list(range(8)), LAYOUT, names=names))
    group, lb = SendingGroup(), LAYOUT.layer_block_bytes
    copies: list[int] = []

    def wire(tensor: torch.Tensor) -> torch.Tensor:  # the device copy NCCL sends from
        copies.append(tensor.numel())
        return tensor.clone()

    server = Server(
        OwnStore(), group, held, Session(None),  # type: ignore[arg-type]
        layer_bytes=lb, parts=lambda count: [(layer, a, a + 1) for layer in range(2) for a in range(count)],
        wire=wire, timeout_s=5.0, hold_s=60.0, on_break=lambda reason: None, backend="nccl", wire_budget=3 * lb,
    )  # fmt: skip
    server._answer(Request(1, tuple(names)))
    assert len(copies) == 1 + 2 * 8 and not group.in_flight  # the header, then 16 one-block parts, all sent
    assert group.most <= 3 * lb + copies[0]  # the header plus at most the budget of parts


# -- late data, over real processes (gloo on loopback, the consumer receives straight into its cache) ----------
def late_consumer(port: int, out: Any, events: dict[str, Any]) -> None:
    """Fail a fetch from a frozen producer, then keep watching the target blocks while it resumes and answers."""
    from kvdi.connectors.base import KVRequest
    from kvdi.containers import build_kv_container
    from tests.connectors import test_p2p as pair

    try:
        container = build_kv_container(pair.p2p_settings("kv_consumer", port))
        sched, worker = pair.halves(container)
        caches = pair.random_caches(container.layout(), seed=2)
        worker.register_kv_caches(caches)
        events["published"].wait(pair.WAIT_S)
        matched, _ = sched.get_num_new_matched_tokens(pair.PROMPT, 0)
        events["looked_up"].set()
        events["go"].wait(pair.WAIT_S)
        before = {n: c[list(pair.CONSUMER_BLOCKS)].clone() for n, c in caches.items()}
        sched.update_state_after_alloc(pair.PROMPT, pair.CONSUMER_BLOCKS, matched)
        step = pair.one_step(pair.PROMPT, pair.CONSUMER_BLOCKS, matched)
        worker.bind_connector_metadata(sched.build_connector_meta(step))
        worker.start_load_kv()
        out.put(("failed", sorted(worker.get_block_ids_with_load_errors())))
        worker.clear_connector_metadata()
        events["resumed"].wait(pair.WAIT_S)
        time.sleep(2.0)  # the resumed producer answers the fetch now
        unchanged = all(torch.equal(caches[n][list(pair.CONSUMER_BLOCKS)], before[n]) for n in caches)
        again = sched.get_num_new_matched_tokens(KVRequest("req-2", pair.PROMPT.prompt_token_ids), 0)[0]
        out.put(("late", {"unchanged": unchanged, "again": again}))
        events["consumer_done"].set()
        container.shutdown_resources()
    except Exception as exc:
        out.put(("consumer_error", f"{type(exc).__name__}: {exc}"))


def test_a_fetch_that_timed_out_never_lands_late_in_the_cache(kvdi_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer freezes (SIGSTOP) before answering, the fetch fails within the timeout, then the producer
    resumes and sends its answer: nothing of it reaches the blocks the engine now recomputes."""
    import multiprocessing as mp
    import signal
    from queue import Empty

    from tests.connectors import test_p2p as pair

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    port, out = pair.free_port(), ctx.Queue()
    events = {k: ctx.Event() for k in ("published", "looked_up", "go", "consumer_done", "resumed")}
    producer = ctx.Process(target=pair.producer, args=(port, out, events, 4, 60.0), daemon=True)
    consumer_proc = ctx.Process(target=late_consumer, args=(port, out, events), daemon=True)
    producer.start()
    consumer_proc.start()
    reports: dict[str, Any] = {}

    def report(key: str) -> Any:
        deadline = time.monotonic() + pair.WAIT_S
        while key not in reports:
            try:
                k, v = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except Empty:
                pytest.fail(f"no {key!r} report (got {sorted(reports)})")
            assert not k.endswith("_error"), f"{k}: {v}"
            reports[k] = v
        return reports[key]

    try:
        assert events["looked_up"].wait(pair.WAIT_S)
        os.kill(producer.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        events["go"].set()
        assert report("failed") == list(pair.CONSUMER_BLOCKS[: pair.LOADED])
        os.kill(producer.pid, signal.SIGCONT)  # type: ignore[arg-type]
        events["resumed"].set()
        assert report("late") == {"unchanged": True, "again": 0}
    finally:
        for proc in (consumer_proc, producer):
            proc.join(pair.WAIT_S if proc.is_alive() else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


# -- a fetch that fails after the header, over a real gloo pair (two ranks on threads, loopback) -----------
def gloo_pair() -> dict[Any, Any]:
    """Two real ``ProcessGroupGloo`` ranks of one pair (keys 0 and 1, with their stores), made on two threads."""
    import threading

    from tests.connectors.test_p2p import free_port

    port, made, errors = free_port(), {}, []

    def rank(r: int) -> None:
        try:
            store = torch.distributed.TCPStore("127.0.0.1", port, 2, r == 0, timedelta(seconds=20))
            made[r] = groups.make_group(
                "gloo", store, r, timeout=timedelta(seconds=20), device=torch.device("cpu"), host="127.0.0.1",
                deadline=time.monotonic() + 20,
            )  # fmt: skip
            made[f"store{r}"] = store
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and 0 in made and 1 in made, errors
    return made


def test_a_gloo_fetch_failing_after_the_header_leaves_no_receive_to_land_late() -> None:
    """The consumer fails on the first part it got (its own handling raised) while the producer's next part
    is still on its way: receive() raises only once that part is settled, so the buffers never change after."""
    import threading

    from kvdi.connectors.p2p.protocol import PRODUCER_RANK, tag

    pair = gloo_pair()
    producer_group = pair[0]
    channel = receiving_channel(Group(failing_part=0))
    channel._pg = pair[1]
    lb = LAYOUT.layer_block_bytes
    parts = [torch.full((2 * lb,), 10 + layer, dtype=torch.uint8) for layer in range(LAYOUT.num_layers)]
    assert PRODUCER_RANK == 0

    def produce() -> None:  # the answer's parts: the second one late
        for part, data in enumerate(parts, start=1):
            if part > 1:
                time.sleep(0.5)
            producer_group.send([data], 1, tag(7, part)).wait(timedelta(seconds=10))
        producer_group.send([torch.ones(1, dtype=torch.uint8)], 1, tag(8, 0)).wait(timedelta(seconds=10))

    def refuse(layer: int, first: int, stop: int) -> None:
        raise RuntimeError("the consumer's copy of a part failed")

    sender = threading.Thread(target=produce)
    sender.start()
    buffers = [torch.zeros(2 * lb, dtype=torch.uint8) for _ in range(LAYOUT.num_layers)]
    answer = Answer(7, (True, True), torch.zeros(0, dtype=torch.uint8), time.monotonic() + 5)
    with pytest.raises(P2pTransferError, match="copy of a part failed"):
        channel.receive(answer, buffers, refuse)
    after = [b.clone() for b in buffers]
    marker = torch.zeros(1, dtype=torch.uint8)  # sent after every part on the same connection: they arrived
    pair[1].recv([marker], 0, tag(8, 0)).wait(timedelta(seconds=10))
    sender.join(15)
    assert all(torch.equal(b, a) for b, a in zip(buffers, after, strict=True))  # nothing landed late


def fetch_failing_after_the_header(device: str) -> None:
    """The header and the first layer arrive, the second layer comes only after the fetch's deadline: the
    fetch fails, its timed-out receive closed the pair, and the late part lands neither in the host
    staging nor in the cache on ``device``, which keep what they held when the failure was raised."""
    import threading

    from kvdi.connectors.p2p.frames import CacheReceiver
    from kvdi.connectors.p2p.protocol import tag

    pair = gloo_pair()
    channel = receiving_channel(Group(failing_part=0))
    channel._pg = pair[1]
    gen = torch.Generator().manual_seed(30)
    source = [torch.randn((16, *LAYOUT.block_shape), generator=gen) for _ in range(2)]
    names = [bytes([b]) * 16 for b in (1, 2)]
    frames = gather_frames(source, [1, 2], LAYOUT, names=names)
    caches = [torch.randn((16, *LAYOUT.block_shape), generator=gen).to(device) for _ in range(2)]
    receiver = CacheReceiver(caches, LAYOUT, torch.device("cpu"), None, None)
    targets = [9, 3]  # not consecutive: staged on the host
    buffers, direct = receiver.buffers(targets)
    assert not direct
    sink = receiver.receiving(buffers, targets, direct, names)
    answer = Answer(5, (True, True), frames.headers, time.monotonic() + 1.0)
    late: list[str] = []

    def produce() -> None:
        pair[0].send([frames.layers[0].contiguous()], 1, tag(5, 1)).wait(timedelta(seconds=10))
        time.sleep(max(0.0, answer.deadline - time.monotonic()) + 0.5)
        try:
            pair[0].send([frames.layers[1].contiguous()], 1, tag(5, 2)).wait(timedelta(seconds=5))
            late.append("sent")
        except RuntimeError as exc:
            late.append(f"failed: {str(exc).splitlines()[0]}")

    sender = threading.Thread(target=produce)
    sender.start()
    with pytest.raises(P2pTransferError):
        channel.receive(answer, buffers, sink)
    staging, cache = buffers[1].clone(), caches[1].cpu()
    sender.join(15)
    assert late and late[0].startswith("failed")  # gloo closed the pair when the receive timed out
    assert torch.equal(buffers[1], staging) and torch.equal(caches[1].cpu(), cache)


def test_a_gloo_fetch_failing_after_the_header_never_lands_late_in_staging_or_the_cache() -> None:
    """CPU twin of the CUDA test (tests/test_cuda.py): a timed-out second part of a staged fetch."""
    fetch_failing_after_the_header("cpu")
