"""Storage: kvdi's worker half over cpu_offload and shared_storage next to raw operations on the same bytes.

(The keyed MAC's cost as a ratio to the checksum is :mod:`kvdi.bench.integrity`, ``kvdi bench integrity``;
the per-block breakdown of where the time goes is ``python -m benchmarks.profile_stores``.)

The blocks are 1 MiB each (8 layers x 128 KiB: 2 x 16 tokens x 8 heads x 128 dims x fp32),
in requests of 16 blocks. kvdi moves them through the real
:class:`~kvdi.connectors.store.StoreWorkerConnector` built by the container (register the
caches, bind :class:`BlockTransferMetadata`, ``wait_for_save`` / ``start_load_kv``): frame
header, xxh3 checksum on save, every frame verified on load. Baselines move the same bytes:

- ``torch copy, 1 thread``: one ``Tensor.copy_`` per layer between the cache and a host buffer
  (cpu_offload; target 0.9x);
- ``raw sequential file write / read``: one file written / read with ``os.write`` / ``os.readv``
  (shared_storage, warm page cache; targets 0.75x save, 0.85x load);
- ``raw cold reads of the same files``: kvdi's own object files opened and read one after the
  other with ``os.readv``, no checks, after ``posix_fadvise(DONTNEED)`` evicted them from the page
  cache (written back first); kvdi's cold load starts from the same evicted state (target 0.8x);
- ``vLLM example layout``: one folder per request (MD5 of its tokens), one safetensors file
  per layer, KV gathered / scattered per token through a slot mapping, written with
  ``save_file`` and read with ``load_file``, as vLLM's ExampleConnector does (no target).

kvdi moves bytes on one thread, so targeted baselines run torch on one thread too (like for
like: the ratio then measures kvdi's overhead, not thread counts); rows without a target repeat
them with torch's default thread count. Every comparison is the median of its runs, kvdi and
its baseline alternated (ABAB, then BABA) so that load from other processes hits both alike; the note
gives the spread of the ratio round by round (its lowest and highest).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvdi.bench import BenchResult
from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata, WorkerConnector, run_transfer_step
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.keys import block_keys
from kvdi.containers import build_kv_container

BLOCK_SIZE = 16
BLOCKS_PER_REQUEST = 16
MODEL = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "num_heads": 8, "hidden_size": 1024}
NOTE = "{cache} page cache on both sides; median of {r} runs, alternated; {n} x 1 MiB blocks"


Timed = Callable[[], None] | tuple[Callable[[], None], Callable[[], None]]


def _step(worker: WorkerConnector, meta: BlockTransferMetadata) -> None:
    failed = run_transfer_step(worker, meta)
    if failed:
        raise RuntimeError(f"bench: {len(failed)} blocks failed to load")


class Rounds(list[float]):
    """The wall times of one timed function, one per round (in round order); ``median`` is what is reported."""

    @property
    def median(self) -> float:
        return statistics.median(self)


def _median_seconds(fns: list[Timed], repeats: int) -> list[float]:
    """Median wall time of each ``fn`` (or ``(prepare, fn)``, prepare untimed), alternated so drift hits all alike."""
    return [r.median for r in _rounds(fns, repeats)]


def _rounds(fns: list[Timed], repeats: int) -> list[Rounds]:
    """Wall time of each ``fn`` (or ``(prepare, fn)``, prepare untimed) in each round.

    One warm-up run each; then rounds in order and in reverse order by turns (ABAB, BABA).
    """
    pairs = [fn if isinstance(fn, tuple) else (_nothing, fn) for fn in fns]
    for prepare, fn in pairs:
        prepare()
        fn()  # warm-up: page cache, allocations, first-touch faults
    times = [Rounds() for _ in pairs]
    for r in range(repeats):
        order = list(enumerate(pairs))
        for i, (prepare, fn) in order if r % 2 == 0 else reversed(order):
            prepare()
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return times


_best_seconds = _median_seconds  # the name kvdi.bench.integrity and older scripts use


def _on_threads(n: int, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run with torch limited to ``n`` threads (restored after)."""
    import torch

    def run() -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            fn()
        finally:
            torch.set_num_threads(before)

    return run


def _nothing() -> None:
    return None


def _empty_dir(path: Path) -> None:
    """Remove what a previous save wrote, so every timed save writes new files (not overwrites)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)


def _remove_objects(root: Path) -> None:
    """Remove the store's objects but keep its fan-out directories, as in a store in steady use."""
    for sub in root.iterdir():
        for obj in sub.iterdir():
            obj.unlink()


def _objects(root: Path) -> list[Path]:
    """The store's object files, in name order."""
    return sorted(p for sub in root.iterdir() if sub.is_dir() for p in sub.iterdir() if not p.name.startswith("."))


def evict_from_page_cache(paths: list[Path]) -> None:
    """Write ``paths`` back and drop them from the page cache (``posix_fadvise(DONTNEED)``): the next read is cold."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _Setup:
    """The cache, the transfers and a kvdi worker half for one connector."""

    def __init__(self, connector: str, num_blocks: int, tmp: Path, **settings: Any) -> None:
        import torch

        self.container = build_kv_container(
            **settings,
            kv_connector=connector,
            model=MODEL,
            allocator={"device": "cpu", "block_size": BLOCK_SIZE, "dtype": "float32"},
            cpu_offload={"max_bytes": num_blocks * (HEADER_SIZE + (1 << 20))},
            shared_storage={"path": str(tmp / "kvdi")},
            engine_id="bench",
        )
        self.layout = self.container.layout()
        worker = self.container.worker_connector()
        if not isinstance(worker, WorkerConnector):
            raise TypeError(f"bench: {connector!r} built no worker half")
        self.worker = worker
        gen = torch.Generator().manual_seed(0)
        shape = (num_blocks, *self.layout.block_shape)
        self.caches = {n: torch.randn(shape, generator=gen) for n in self.layout.layer_names}
        self.worker.register_kv_caches(self.caches)
        self.u8 = [c.view(torch.uint8).view(num_blocks, -1) for c in self.caches.values()]
        self.requests: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (tokens, block ids)
        transfers = []
        for r in range(num_blocks // BLOCKS_PER_REQUEST):
            tokens = tuple(range(r * 100_000, r * 100_000 + BLOCKS_PER_REQUEST * BLOCK_SIZE + 1))
            ids = tuple(range(r * BLOCKS_PER_REQUEST, (r + 1) * BLOCKS_PER_REQUEST))
            keys = tuple(block_keys(tokens, self.layout))
            transfers.append(BlockTransfer(f"r{r}", ids, keys))
            self.requests.append((tokens, ids))
        self.save_meta = BlockTransferMetadata(saves=tuple(transfers))
        self.load_meta = BlockTransferMetadata(loads=tuple(transfers))
        self.nbytes = len(transfers) * BLOCKS_PER_REQUEST * self.layout.block_bytes

    def save(self) -> None:
        _step(self.worker, self.save_meta)

    def load(self) -> None:
        _step(self.worker, self.load_meta)

    def close(self) -> None:
        self.container.shutdown_resources()


def _result(
    metric: str, nbytes: int, kvdi_s: Rounds, base_s: Rounds, base: str, target: float | None, note: str
) -> BenchResult:
    """GB/s of the medians, their ratio, and in the note the spread of the ratio round by round (min-max)."""
    kvdi, baseline = nbytes / kvdi_s.median / 1e9, nbytes / base_s.median / 1e9
    per_round = [b / k for k, b in zip(kvdi_s, base_s, strict=True)]
    note = f"{note}; ratio per round {min(per_round):.2f}-{max(per_round):.2f}"
    return BenchResult("storage", metric, "GB/s", round(kvdi, 3), round(baseline, 3), base, round(kvdi / baseline, 3),
                       target, note)  # fmt: skip


def bench_cpu_offload(num_blocks: int, repeats: int, tmp: Path) -> list[BenchResult]:
    """cpu_offload save/load vs one torch copy per layer of the same bytes into a host buffer."""
    import torch

    s = _Setup("cpu_offload", num_blocks, tmp)
    threads = torch.get_num_threads()
    try:
        pool = torch.empty((num_blocks, len(s.u8), s.layout.layer_block_bytes), dtype=torch.uint8)

        def raw_save() -> None:
            for i, u in enumerate(s.u8):
                pool[:, i].copy_(u)

        def raw_load() -> None:
            for i, u in enumerate(s.u8):
                u.copy_(pool[:, i])

        fns: list[Timed] = [
            s.save,
            _on_threads(1, raw_save),
            _on_threads(threads, raw_save),
            s.load,
            _on_threads(1, raw_load),
            _on_threads(threads, raw_load),
        ]
        save, base_save, all_save, load, base_load, all_load = _rounds(fns, repeats)
        note = f"host memory; median of {repeats} runs, alternated; {num_blocks} x 1 MiB blocks"
        every = f"torch copy, {threads} threads"
        return [
            _result("cpu_offload save", s.nbytes, save, base_save, "torch copy, 1 thread", 0.9, note),
            _result("cpu_offload load", s.nbytes, load, base_load, "torch copy, 1 thread", 0.9, note),
            _result("cpu_offload save", s.nbytes, save, all_save, every, None, note),
            _result("cpu_offload load", s.nbytes, load, all_load, every, None, note),
        ]
    finally:
        s.close()


def _write_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        view = view[os.write(fd, view) :]


def _read_all(fd: int, view: memoryview) -> None:
    while view.nbytes:
        n = os.readv(fd, [view])
        if n == 0:
            raise EOFError("bench file is shorter than expected")
        view = view[n:]


def bench_shared_storage(num_blocks: int, repeats: int, tmp: Path) -> list[BenchResult]:
    """shared_storage save/load vs one raw file and vs vLLM's per-layer safetensors layout."""
    import torch

    # safetensors is optional: without it only the raw-file comparison runs.
    has_safetensors = importlib.util.find_spec("safetensors") is not None

    s = _Setup("shared_storage", num_blocks, tmp)
    raw_path = tmp / "raw.bin"
    example_root = tmp / "vllm_example"
    views = [u.numpy().data.cast("B") for u in s.u8]

    def raw_save() -> None:
        fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for v in views:
                _write_all(fd, v)
        finally:
            os.close(fd)

    def raw_load() -> None:
        fd = os.open(raw_path, os.O_RDONLY)
        try:
            for v in views:
                _read_all(fd, v)
        finally:
            os.close(fd)

    def folder(tokens: tuple[int, ...]) -> Path:
        return example_root / hashlib.md5(str(tokens).encode(), usedforsecurity=False).hexdigest()

    # The example connector moves KV per token through a slot mapping (gather on save, scatter on load).
    def slots(ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.tensor(ids).repeat_interleave(BLOCK_SIZE)
        return blocks, torch.arange(BLOCK_SIZE).repeat(len(ids))

    index = [(folder(t), *slots(ids)) for t, ids in s.requests]

    def example_save() -> None:
        from safetensors.torch import save_file

        for path, blocks, offsets in index:
            path.mkdir(parents=True, exist_ok=True)
            for name, cache in s.caches.items():
                save_file({"kv_cache": cache[blocks, :, offsets]}, str(path / f"{name}.safetensors"))

    def example_load() -> None:
        from safetensors.torch import load_file

        for path, blocks, offsets in index:
            for name, cache in s.caches.items():
                cache[blocks, :, offsets] = load_file(str(path / f"{name}.safetensors"))["kv_cache"]

    def raw_read_files(paths: list[Path]) -> Callable[[], None]:
        """Read whole files one after the other with plain syscalls (no checks): the medium's pace for them."""
        size = HEADER_SIZE + s.layout.block_bytes
        buf = memoryview(bytearray(size))

        def run() -> None:
            for path in paths:
                fd = os.open(path, os.O_RDONLY)
                try:
                    _read_all(fd, buf)
                finally:
                    os.close(fd)

        return run

    files_root = tmp / "files"
    blocks = [[memoryview(bytes(HEADER_SIZE)), *(v[b * len(v) // num_blocks : (b + 1) * len(v) // num_blocks]
                                                 for v in views)] for b in range(num_blocks)]  # fmt: skip

    def raw_write_files() -> None:
        """Each block (a header's worth of bytes, then its layers) into a new file of its own: the layout's floor."""
        for b, pieces in enumerate(blocks):
            fd = os.open(files_root / str(b), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.writev(fd, pieces)
            finally:
                os.close(fd)

    threads = torch.get_num_threads()
    try:
        store_dir = tmp / "kvdi"
        s.save()
        clear_example = partial(_empty_dir, example_root)
        fns: list[Timed] = [
            (partial(_remove_objects, store_dir), s.save),
            (partial(raw_path.unlink, missing_ok=True), raw_save),
            (partial(_empty_dir, files_root), raw_write_files),
        ]
        loads: list[Timed] = [s.load, raw_load, raw_read_files(_objects(store_dir))]
        if has_safetensors:
            fns += [(clear_example, _on_threads(1, example_save)), (clear_example, _on_threads(threads, example_save))]
            loads += [_on_threads(1, example_load), _on_threads(threads, example_load)]
        timed = _rounds(fns + loads, repeats)
        saves, loaded = timed[: len(fns)], timed[len(fns) :]
        note = NOTE.format(cache="warm", r=repeats, n=num_blocks)
        baselines = [
            ("raw sequential file write", "raw sequential file read", 0.75, 0.85),
            ("raw writes, one new file per block", "raw reads of the same files", None, None),
            ("vLLM example layout, torch on 1 thread",) * 2 + (None, None),
            (f"vLLM example layout, torch on {threads} threads",) * 2 + (None, None),
        ]
        results = []
        for i, (save_name, load_name, save_target, load_target) in enumerate(baselines[: len(fns) - 1], 1):
            results.append(_result("shared_storage save", s.nbytes, saves[0], saves[i], save_name, save_target, note))
            results.append(_result("shared_storage load", s.nbytes, loaded[0], loaded[i], load_name, load_target, note))
        objects = _objects(store_dir)
        cold = partial(evict_from_page_cache, [*objects, raw_path])
        kvdi_cold, files_cold, file_cold = _rounds(
            [(cold, s.load), (cold, raw_read_files(objects)), (cold, raw_load)], max(3, repeats // 2)
        )
        note = NOTE.format(cache="cold (posix_fadvise DONTNEED)", r=max(3, repeats // 2), n=num_blocks)
        results.append(_result("shared_storage cold load", s.nbytes, kvdi_cold, files_cold,
                               "raw cold reads of the same files", 0.8, note))  # fmt: skip
        results.append(_result("shared_storage cold load", s.nbytes, kvdi_cold, file_cold,
                               "raw cold sequential file read", None, note))  # fmt: skip
        return results
    finally:
        s.close()


def run(quick: bool) -> list[BenchResult]:
    """All storage comparisons: 64 blocks x 5 runs when ``quick``, else 256 blocks x 9 runs."""
    num_blocks, repeats = (64, 5) if quick else (256, 9)
    with tempfile.TemporaryDirectory(prefix="kvdi-bench-storage-") as name:
        tmp = Path(name)
        return [*bench_cpu_offload(num_blocks, repeats, tmp), *bench_shared_storage(num_blocks, repeats, tmp)]


def main(argv: Any = None) -> None:  # pragma: no cover - manual runs
    for r in run(quick=bool(argv)):
        print(f"{r.metric:25} {r.kvdi:6.2f} vs {r.baseline:6.2f} GB/s  {r.baseline_name:40} ratio {r.ratio:5.2f} "
              f"(target {r.target})")  # fmt: skip


if __name__ == "__main__":  # pragma: no cover
    import sys

    main(sys.argv[1:] or None)
