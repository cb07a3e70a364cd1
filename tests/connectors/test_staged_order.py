"""A device cache's ``nhc`` blocks put in a canonical store's ``hnc`` order on the device (:mod:`kvdi.connectors.store.
staged_order`), without a GPU: the store worker over real files, its CPU cache staged like a device cache through
a :class:`~kvdi.testing.cuda_recording.RecordingCuda` (real copies, every call recorded). The same on a GPU:
``tests/test_cuda.py``."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvdi.connectors.store.blockio as blockio
import kvdi.connectors.store.canonical_io as canonical_io
import kvdi.connectors.store.canonical_store as canonical_store
from kvdi.connectors.base import ConnectorContext, KVConnectorRole
from kvdi.connectors.cpu_offload import HostPoolStore
from kvdi.connectors.multi import TieredStore
from kvdi.connectors.shared_storage import FileBlockStore, open_store
from kvdi.connectors.store import BlockStore, StoreWorkerConnector
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.streams import StreamOrder
from kvdi.layout import KVCacheSpec
from kvdi.settings import KvdiSettings
from kvdi.testing.cuda_recording import COPY_KINDS, RecordingCuda, count_host_waits
from tests.helpers.canonical import BS, HEADS, LAYERS, WHOLE, rank_layout, step

NHC = KVCacheSpec(WHOLE.model_id, LAYERS, HEADS, 8, BS, "float32", block_order="nhc")
SAVED, LOADED = (0, 1, 2, 3), (8, 9, 10, 11)
TODAY_SAVE = ["copy", *["gather"] * LAYERS, "copy"]  # ids up, a gather a layer, the chunk to the host
TODAY_LOAD = ["copy", "copy", *["scatter"] * LAYERS]  # ids up, the chunk to the device, a scatter a layer


def settings(root: Path) -> KvdiSettings:
    return KvdiSettings(kv_role="kv_both", engine_id="test", shared_storage={"path": str(root), "format": "canonical"})


def canonical(root: Path, layout: KVCacheSpec) -> BlockStore:
    s = settings(root)
    return open_store(s.shared_storage, layout, s)


def caches(layout: KVCacheSpec, hnc: bool, seed: int | None = None) -> dict[str, torch.Tensor]:
    """Per layer ``[B, N, H, 2D]`` (``nhc``) or ``[B, H, N, 2D]`` (``hnc``): random, or zeros without a seed."""
    h, n = layout.num_kv_heads, layout.block_size
    shape = (16, h, n, 2 * layout.head_dim) if hnc else (16, n, h, 2 * layout.head_dim)
    gen = torch.Generator().manual_seed(seed or 0)
    return {name: torch.randn(shape, generator=gen) if seed else torch.zeros(shape) for name in layout.layer_names}


def half(store: BlockStore, layout: KVCacheSpec, cache: dict[str, torch.Tensor]) -> StoreWorkerConnector:
    s = settings(Path("unused"))
    worker = StoreWorkerConnector(ConnectorContext("shared_storage", KVConnectorRole.WORKER, s, layout, None, store))
    worker.register_kv_caches(cache)
    return worker


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> RecordingCuda:
    """From here on the store worker stages its CPU caches as device caches, ordered through the recorder."""
    cuda = RecordingCuda()
    monkeypatch.setattr(blockio, "order_for", lambda device: StreamOrder("cuda:0", cuda))
    monkeypatch.setattr(blockio, "CacheIOs", functools.partial(blockio.CacheIOs, staging=True))
    return cuda


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """How often the host's strided conversions ran (an observation: each still runs)."""
    seen: Counter[str] = Counter()

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(canonical_io, "pack_block", counted("pack_block", canonical_io.pack_block))
    monkeypatch.setattr(canonical_io, "unpack_block", counted("unpack_block", canonical_io.unpack_block))
    monkeypatch.setattr(canonical_store, "unpack_block", counted("unpack_block", canonical_store.unpack_block))
    yield seen


def kinds(log: list[tuple[Any, ...]]) -> list[Any]:
    return [e[0] for e in log if e[0] in COPY_KINDS]


def save_then_load(worker: StoreWorkerConnector, cuda: RecordingCuda) -> tuple[list[Any], list[Any]]:
    """Save :data:`SAVED`, load them into :data:`LOADED`: each step's recorded calls."""
    del cuda.log[:]
    assert step(worker, SAVED, save=True) == set()
    saved = list(cuda.log)
    del cuda.log[:]
    assert step(worker, LOADED, save=False) == set()
    return saved, list(cuda.log)


def test_a_staged_nhc_cache_saves_hnc_frames_on_the_device_that_every_shape_loads(
    tmp_path: Path, staged: RecordingCuda, conversions: Counter[str]
) -> None:
    store = canonical(tmp_path / "kv", NHC)
    src = caches(NHC, hnc=False, seed=1)
    writer = half(store, NHC, src)
    assert store.rank.order == "hnc" and store.rank.write_runs is not None and store.rank.read_runs is not None
    saved, loaded = save_then_load(writer, staged)
    # (c) one permuted device copy more a chunk each way than a per-rank store, one host wait each
    assert kinds(saved) == [*TODAY_SAVE[:-1], "copy", "copy"] and count_host_waits(saved) == 1
    assert kinds(loaded) == [*TODAY_LOAD[:2], "copy", *TODAY_LOAD[2:]] and count_host_waits(loaded) == 1
    # (b) the staged cache loads its blocks back exactly
    assert all(torch.equal(src[n][list(LOADED)], src[n][list(SAVED)]) for n in NHC.layer_names)
    # (a) a TP=1 hnc host cache, and each rank of a TP=2 pair, load the same KV values
    as_hnc = {n: t.permute(0, 2, 1, 3) for n, t in src.items()}  # [B, H, N, 2D]
    hnc = KVCacheSpec(WHOLE.model_id, LAYERS, HEADS, 8, BS, "float32", block_order="hnc")
    for layout, heads in [(hnc, slice(0, HEADS)), (rank_layout(0, order="hnc"), slice(0, 1)),
                          (rank_layout(1, order="hnc"), slice(1, 2))]:  # fmt: skip
        dst = caches(layout, hnc=True)
        with pytest.MonkeyPatch.context() as host:
            host.setattr(blockio, "CacheIOs", blockio.CacheIOs.func)
            reader = half(canonical(tmp_path / "kv", layout), layout, dst)
            assert step(reader, LOADED, save=False) == set()
        assert all(torch.equal(dst[n][list(LOADED)], as_hnc[n][list(SAVED)][:, heads]) for n in NHC.layer_names)
    assert conversions == {}  # the host converted nothing: sections framed from and read into the staged rows


def test_the_sections_saved_from_the_device_are_the_bytes_a_host_nhc_writer_stores(
    tmp_path: Path, staged: RecordingCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = caches(NHC, hnc=False, seed=2)
    save_then_load(half(canonical(tmp_path / "device", NHC), NHC, src), staged)
    monkeypatch.setattr(blockio, "CacheIOs", blockio.CacheIOs.func)  # a host cache
    assert step(half(canonical(tmp_path / "host", NHC), NHC, src), SAVED, save=True) == set()
    files = {
        p.relative_to(tmp_path / "device"): p.read_bytes() for p in (tmp_path / "device").rglob("*") if p.is_file()
    }
    assert len(files) == len(SAVED)
    assert {p: (tmp_path / "host" / p).read_bytes() for p in files} == files


def test_a_per_rank_store_sees_todays_calls_and_layout_order(tmp_path: Path, staged: RecordingCuda) -> None:
    """(d) per-rank frames stay in the layout's order, with exactly the calls they made before."""
    layout = KVCacheSpec("m", LAYERS, HEADS, 8, BS, "float32", block_order="nhc")
    src = caches(layout, hnc=False, seed=3)
    saved, loaded = save_then_load(half(FileBlockStore(tmp_path), layout, src), staged)
    assert kinds(saved) == TODAY_SAVE and kinds(loaded) == TODAY_LOAD
    assert count_host_waits(saved) == count_host_waits(loaded) == 1
    assert all(torch.equal(src[n][list(LOADED)], src[n][list(SAVED)]) for n in layout.layer_names)


def test_a_pool_in_front_of_a_canonical_tier_keeps_the_layouts_order_and_tiers_all_canonical_convert(
    tmp_path: Path, staged: RecordingCuda
) -> None:
    """multi: a process-local pool's per-rank frames never change order (no conversion at all, the canonical tier
    behind it converts on the host as before); canonical tiers only: converted on the device, loaded exactly."""
    frame = HEADER_SIZE + NHC.block_bytes
    for tiers, converted in [((HostPoolStore(16, frame),), False), ((), True)]:
        root = tmp_path / str(converted)
        behind = canonical(root, NHC)
        multi = TieredStore([*(("cpu_offload", t) for t in tiers), ("shared_storage", behind)])
        src = caches(NHC, hnc=False, seed=4)
        saved, loaded = save_then_load(half(multi, NHC, src), staged)
        assert behind.rank.order == ("hnc" if converted else "nhc")
        assert kinds(saved) == ([*TODAY_SAVE[:-1], "copy", "copy"] if converted else TODAY_SAVE)
        assert kinds(loaded) == ([*TODAY_LOAD[:2], "copy", *TODAY_LOAD[2:]] if converted else TODAY_LOAD)
        assert all(torch.equal(src[n][list(LOADED)], src[n][list(SAVED)]) for n in NHC.layer_names)
        if tiers:  # without the pool: the sections written from the host's conversion load on the device
            tiers[0].close()
            multi.tiers = multi.tiers[1:]
            again = caches(NHC, hnc=False)
            assert step(half(multi, NHC, again), LOADED, save=False) == set()
            assert all(torch.equal(again[n][list(LOADED)], src[n][list(SAVED)]) for n in NHC.layer_names)


def test_a_new_registration_of_a_host_cache_undoes_the_conversion(
    tmp_path: Path, staged: RecordingCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = canonical(tmp_path, NHC)
    worker = half(store, NHC, caches(NHC, hnc=False, seed=5))
    assert store.rank.order == "hnc"
    monkeypatch.setattr(blockio, "CacheIOs", blockio.CacheIOs.func)
    worker.register_kv_caches(caches(NHC, hnc=False, seed=5))  # a CPU cache: read and written as it is
    assert store.rank.order == "nhc" and store.rank.write_runs is None


@pytest.mark.parametrize("store_format", ["per_rank", "canonical"])
def test_a_chunk_of_16_blocks_of_32_layers_takes_34_calls_each_way_and_one_more_converted(
    tmp_path: Path, staged: RecordingCuda, store_format: str
) -> None:
    """The issue-29 count (ids up, 32 gathers or scatters, one host copy) stays 34 for per-rank frames; converting
    adds the one permuted copy: 35, whatever the number of blocks or layers. One host wait each way."""
    from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata, run_transfer_step

    layout = KVCacheSpec(f"big{'#canonical' if store_format == 'canonical' else ''}", 32, 2, 8, 4, "float32",
                         block_order="nhc")  # fmt: skip
    store = canonical(tmp_path, layout) if store_format == "canonical" else FileBlockStore(tmp_path)
    src = {n: torch.randn(32, 4, 2, 16) for n in layout.layer_names}
    worker = half(store, layout, src)
    keys = tuple(bytes([b]) * 16 for b in range(16))
    counts = []
    for ids, save in [(tuple(range(16)), True), (tuple(range(16, 32)), False)]:
        del staged.log[:]
        transfer = (BlockTransfer("r", ids, keys),)
        assert (
            run_transfer_step(worker, BlockTransferMetadata(() if save else transfer, transfer if save else ()))
            == set()
        )
        counts.append((len(kinds(staged.log)), count_host_waits(staged.log)))
    assert counts == [(34 + (store_format == "canonical"), 1)] * 2
    assert all(torch.equal(t[16:], t[:16]) for t in src.values())
