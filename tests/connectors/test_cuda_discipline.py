"""How kvdi's store copies to and from a CUDA cache are ordered (kvdi.connectors.streams, CacheIO), without a GPU.

CacheIO runs on CPU tensors with a host bounce (``staging=True``) and a
:class:`~kvdi.testing.cuda_recording.RecordingCuda`: the copies really happen, and every stream and
event call is recorded, so each test checks where a copy ran and what the host waited for. The same
paths on a real GPU (under a busy compute stream) are in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvdi.connectors.store.blockio import CacheIO
from kvdi.connectors.streams import StreamOrder
from kvdi.layout import KVCacheSpec
from kvdi.testing.cuda_recording import COPY_KINDS, RecordingCuda, count_copies, count_host_waits

LAYERS, BLOCKS, LAYER_BYTES = 2, 8, 64


@pytest.fixture(autouse=True)
def _no_device_wide_synchronize(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object) -> None:
        raise AssertionError("torch.cuda.synchronize on the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


def cache_io() -> tuple[CacheIO, list[torch.Tensor], RecordingCuda]:
    caches = [torch.zeros(BLOCKS, LAYER_BYTES // 4, dtype=torch.float32) for _ in range(LAYERS)]
    cuda = RecordingCuda()
    return CacheIO(caches, LAYER_BYTES, chunk=4, staging=True, order=StreamOrder("cuda:0", cuda)), caches, cuda


def fill_row(io: CacheIO, i: int, block_id: int, value: int) -> None:
    for piece in io.load_pieces(i, block_id):
        piece.cast("B")[:] = bytes([value]) * len(piece)


def test_a_synchronous_load_copies_on_the_engine_stream_and_waits_on_its_event_only() -> None:
    """Engine thread: the copies follow the compute queued on the current stream; the host then waits on
    an event after them (before staging is reused), never on the whole device."""
    io, caches, cuda = cache_io()
    fill_row(io, 0, 5, 3)
    io.commit_load(0, 5)
    io.finish()
    assert cuda.log == [
        ("copy", "compute"),  # the block ids, uploaded once
        ("copy", "compute"),  # the staged chunk, host to device, in one copy
        *[("scatter", "compute")] * LAYERS,  # one scatter per layer
        ("record", "e1", "compute"),
        ("host_wait", "e1", "compute"),
    ]
    assert all(bool((c[5].view(torch.uint8) == 3).all()) for c in caches)


def test_a_background_load_waits_for_the_compute_queued_when_it_was_handed_over_and_nothing_else() -> None:
    """The fence is recorded on the engine thread; the job's side stream waits on it before its first copy
    (a reused block's old owner's writes land first) and the host waits on the side stream's event only."""
    io, caches, cuda = cache_io()
    fence = io.fence()  # engine thread, at submit

    def job() -> None:
        with io.on_side_stream(fence):
            fill_row(io, 0, 2, 9)
            io.commit_load(0, 2)
            io.finish()

    worker = threading.Thread(target=job)
    worker.start()
    worker.join()
    assert cuda.log == [
        ("record", "e1", "compute"),
        ("wait_event", "side1", "e1"),
        *[("copy", "side1")] * 2,
        *[("scatter", "side1")] * LAYERS,
        ("record", "e2", "side1"),
        ("host_wait", "e2", "side1"),
    ]
    assert all(bool((c[2].view(torch.uint8) == 9).all()) for c in caches)


def test_a_save_reads_the_block_on_the_engine_stream_and_the_host_waits_before_reading_the_bytes() -> None:
    io, caches, cuda = cache_io()
    for layer, cache in enumerate(caches):
        cache[4].view(torch.uint8).fill_(10 + layer)
    (pieces,) = io.save_pieces([4])
    assert cuda.log[-2:] == [("record", "e1", "compute"), ("host_wait", "e1", "compute")]
    assert cuda.kinds()[:-2] == ["copy", *["gather"] * LAYERS, "copy"] and {e[1] for e in cuda.log[:-2]} == {"compute"}
    assert [bytes(p) for p in pieces] == [b"".join(bytes([10 + layer]) * LAYER_BYTES for layer in range(LAYERS))]


def test_a_cpu_cache_orders_nothing() -> None:
    caches = [torch.zeros(BLOCKS, LAYER_BYTES // 4) for _ in range(LAYERS)]
    io = CacheIO(caches, LAYER_BYTES, chunk=4)
    assert io.direct and io.order is None and io.fence() is None
    with io.on_side_stream(None):
        io.finish()


def test_the_store_worker_fences_an_async_load_at_hand_over_and_runs_it_on_the_side_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the real store worker and shared_storage files: the fence is recorded by start_load_kv on
    the engine thread, the job's stream waits on it before loading, and the bytes arrive."""
    import kvdi.connectors.store.blockio as blockio
    from kvdi.connectors.base import BlockTransfer, ConnectorContext, KVConnectorRole
    from kvdi.connectors.shared_storage import FileBlockStore
    from kvdi.connectors.store import StoreWorkerConnector
    from kvdi.connectors.store.scheduler import StoreTransferMetadata
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import load_settings

    cuda = RecordingCuda()
    monkeypatch.setattr(blockio, "order_for", lambda device: StreamOrder("cuda:0", cuda))  # the cache "is on CUDA"
    layout = KVCacheSpec("m", LAYERS, 2, 8, 4, "float32")
    settings = load_settings(kv_role="kv_both", transfer={"async_save": False})
    worker = StoreWorkerConnector(
        ConnectorContext("shared_storage", KVConnectorRole.WORKER, settings, layout, None, FileBlockStore(tmp_path))
    )
    caches = {n: torch.randn((BLOCKS, *layout.block_shape)) for n in layout.layer_names}
    worker.register_kv_caches(caches)
    saved = {n: c[1].clone() for n, c in caches.items()}
    worker.bind_connector_metadata(StoreTransferMetadata(saves=(BlockTransfer("w", (1,), (b"k" * 16,)),)))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    del cuda.log[:]
    worker.bind_connector_metadata(StoreTransferMetadata(async_loads=(BlockTransfer("r", (6,), (b"k" * 16,)),)))
    worker.start_load_kv()
    worker.flush()
    assert cuda.log[:2] == [("record", cuda.log[0][1], "compute"), ("wait_event", "side1", cuda.log[0][1])]
    assert all(torch.equal(caches[n][6], saved[n]) for n in caches)
    worker.shutdown()


def test_a_new_registration_never_hands_a_job_the_old_caches_and_replaces_their_staging() -> None:
    """Re-registration (vLLM's restore after sleep): a job of the new registration copies into the new
    caches, never through a staging CacheIO of the old ones given back late, and the allocator's staging
    count holds one registration's buffers, not both."""
    from kvdi.allocator import StagingBuffers
    from kvdi.connectors.store.blockio import CacheIOs

    buffers = StagingBuffers(pin_memory=False)
    old = [torch.zeros(BLOCKS, LAYER_BYTES // 4) for _ in range(LAYERS)]
    first = CacheIOs(old, LAYER_BYTES, 4, buffers, "w/store", staging=True)
    running, idle = first.take(), first.take()  # two jobs of the first registration
    for io in (running, idle):
        io.save_pieces([0])  # each has copied once: it holds its device scratch too
    first.give_back(idle)
    held = buffers.nbytes
    new = [torch.zeros(BLOCKS, LAYER_BYTES // 4) for _ in range(LAYERS)]
    second = CacheIOs(new, LAYER_BYTES, 4, buffers, "w/store", staging=True)
    first.give_back(running)  # the old job ends after the new registration
    job = second.take()
    assert job is not running and job is not idle and second.idle == 0
    fill_row(job, 0, 3, 7)
    job.commit_load(0, 3)
    job.finish()
    assert all(bool((c[3].view(torch.uint8) == 7).all()) for c in new)
    assert not any(c.any() for c in old)
    assert buffers.nbytes == held  # the new buffers replaced the old ones by name


def test_a_background_jobs_host_wait_sleeps_on_a_blocking_event_and_the_engine_threads_spins() -> None:
    """Off the engine thread the host waits on a blocking-sync event (the job's thread does not spin a
    core the engine needs); the engine thread's own short waits stay on a spin-wait event."""
    io, _caches, cuda = cache_io()
    fill_row(io, 0, 1, 4)
    io.commit_load(0, 1)
    io.finish()  # engine thread
    fence = io.fence()

    def job() -> None:
        with io.on_side_stream(fence):
            fill_row(io, 0, 2, 5)
            io.commit_load(0, 2)
            io.finish()
        fill_row(io, 0, 3, 6)  # after the side stream: this thread's waits are spin-waits again
        io.commit_load(0, 3)
        io.finish()

    worker = threading.Thread(target=job)
    worker.start()
    worker.join()
    waited = {entry[1] for entry in cuda.log if entry[0] == "host_wait"}
    assert [(e.name, e.blocking) for e in cuda.events if e.name in waited] == [
        ("e1", False),
        ("e3", True),
        ("e4", False),
    ]


# -- copies per step (issue 29): a fixed number of calls per chunk, whatever the number of blocks --------------
STEP_LAYOUT = KVCacheSpec("m", 4, 2, 8, 4, "float32")


@dataclass
class Steps:
    """What one saving step and one loading step of the store worker recorded."""

    save: list[tuple[object, ...]]  # the whole save, its job included
    load: list[tuple[object, ...]]
    same_bytes: bool  # the loaded blocks equal the saved ones
    blocking: set[str]  # the blocking-sync events (a host wait on them sleeps)


def run_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocks: int, async_save: bool = False, chunk: int | None = None
) -> Steps:
    """The real store worker over shared_storage files, its CPU cache staged like a device cache: a step
    saving ``blocks`` blocks, then a step loading them into other blocks (``chunk`` blocks per staged chunk;
    None: the default 32 MiB). Each store read is logged as ``("read",)`` among the CUDA calls."""
    import kvdi.connectors.store.blockio as blockio
    import kvdi.connectors.store.worker as worker_module
    from kvdi.connectors.base import BlockTransfer, ConnectorContext, KVConnectorRole
    from kvdi.connectors.shared_storage import FileBlockStore
    from kvdi.connectors.store import StoreWorkerConnector
    from kvdi.connectors.store.scheduler import StoreTransferMetadata
    from kvdi.settings import load_settings

    cuda = RecordingCuda()
    monkeypatch.setattr(blockio, "order_for", lambda device: StreamOrder("cuda:0", cuda))
    monkeypatch.setattr(blockio, "CacheIOs", functools.partial(blockio.CacheIOs, staging=True))
    if chunk is not None:
        monkeypatch.setattr(worker_module, "DEVICE_CHUNK_BYTES", chunk * STEP_LAYOUT.block_bytes)

    class LoggedReads(FileBlockStore):
        def get_into_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
            cuda.log.append(("read",))
            return super().get_into_many(items)

    settings = load_settings(kv_role="kv_both", transfer={"async_save": async_save})
    context = ConnectorContext(
        "shared_storage", KVConnectorRole.WORKER, settings, STEP_LAYOUT, None, LoggedReads(tmp_path)
    )
    worker = StoreWorkerConnector(context)
    caches = {n: torch.randn((2 * blocks, *STEP_LAYOUT.block_shape)) for n in STEP_LAYOUT.layer_names}
    worker.register_kv_caches(caches)
    keys = tuple(bytes([b]) * 16 for b in range(blocks))
    save = BlockTransfer("w", tuple(range(blocks)), keys)
    worker.bind_connector_metadata(StoreTransferMetadata(saves=(save,), async_save=async_save))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    worker.flush()
    saved = list(cuda.log)
    del cuda.log[:]
    load = BlockTransfer("r", tuple(range(blocks, 2 * blocks)), keys)
    worker.bind_connector_metadata(StoreTransferMetadata(loads=(load,)))
    worker.start_load_kv()
    worker.clear_connector_metadata()
    same = all(torch.equal(c[blocks:], c[:blocks]) for c in caches.values())
    worker.shutdown()
    return Steps(saved, list(cuda.log), same, {e.name for e in cuda.events if e.blocking})


def _kinds(log: list[tuple[object, ...]]) -> list[object]:
    return [e[0] for e in log if e[0] in COPY_KINDS]


@pytest.mark.parametrize("blocks", [1, 4, 16])
def test_a_synchronous_steps_copy_calls_and_host_waits_do_not_grow_with_its_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocks: int
) -> None:
    """A save and a load of 1, 4 or 16 blocks (one chunk) each make the same calls: the block ids uploaded
    once, one gather (save) or scatter (load) per layer, one host<->device copy; and one host wait
    (before issue 29: one copy per layer per block, and a host wait per 1 MiB chunk)."""
    steps = run_steps(tmp_path, monkeypatch, blocks)
    layers = STEP_LAYOUT.num_layers
    assert steps.same_bytes
    assert _kinds(steps.save) == ["copy", *["gather"] * layers, "copy"] and count_host_waits(steps.save) == 1
    assert _kinds(steps.load) == ["copy", "copy", *["scatter"] * layers] and count_host_waits(steps.load) == 1


@pytest.mark.parametrize("blocks", [1, 16])
def test_an_async_saves_copy_out_runs_in_the_job_after_the_forward_and_the_engine_thread_never_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, blocks: int
) -> None:
    """wait_for_save only records an event on the engine's stream (after the forward queued there); the save
    job's side stream waits on it and copies the blocks out with the same few calls, and the job's thread,
    on a blocking-sync event, is the one that waits for them before hashing and writing."""
    steps = run_steps(tmp_path, monkeypatch, blocks, async_save=True)
    assert steps.same_bytes
    on_compute = [e for e in steps.save if "compute" in e[1:]]
    assert on_compute == [("record", "e1", "compute")]  # the engine's stream: the fence, nothing else
    job = steps.save[1:]
    assert job[0] == ("wait_event", "side1", "e1")
    assert {e[1] for e in job if e[0] in COPY_KINDS} == {"side1"}
    assert count_copies(job) == STEP_LAYOUT.num_layers + 2 and count_host_waits(job) == 1
    waited = {e[1] for e in job if e[0] == "host_wait"}
    assert waited <= steps.blocking


def test_staged_copies_of_layer_pieces_that_are_not_whole_words_move_every_byte() -> None:
    """Gathers and scatters move 8-byte words where a layer's block is a multiple of 8 bytes; a 4-byte one
    goes byte-wise, and a save then a load into another block still moves exactly its bytes."""
    caches = [torch.arange(BLOCKS, dtype=torch.float32).view(BLOCKS, 1) + 100 * layer for layer in range(LAYERS)]
    io = CacheIO(caches, 4, chunk=4, staging=True, order=StreamOrder("cuda:0", RecordingCuda()))
    (pieces,) = io.save_pieces([3])
    (row,) = io.load_pieces(0, 6)
    row.cast("B")[:] = b"".join(bytes(p) for p in pieces)
    io.commit_load(0, 6)
    io.finish()
    assert [float(c[6, 0]) for c in caches] == [3.0 + 100 * layer for layer in range(LAYERS)]
    assert [float(c[5, 0]) for c in caches] == [5.0 + 100 * layer for layer in range(LAYERS)]


def test_a_load_of_several_chunks_reads_the_next_chunk_while_the_previous_ones_copies_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six blocks in chunks of two: each chunk's copies are queued without a host wait, the next chunk is read
    into the other staging slot meanwhile, and the host waits only before reusing a slot (chunk 3 reuses
    chunk 1's) and once at the end: R(ead), C(opy calls), E(vent recorded), W(ait)."""
    steps = run_steps(tmp_path, monkeypatch, 6, chunk=2)
    assert steps.same_bytes
    code = {"read": "R", "record": "E", "host_wait": "W", **dict.fromkeys(COPY_KINDS, "C")}
    chunk = "R" + "C" * (STEP_LAYOUT.num_layers + 2) + "E"
    assert "".join(code[str(e[0])] for e in steps.load) == chunk + chunk + "W" + chunk + "W"
