"""Integrity: what the optional keyed MAC (``KVDI_INTEGRITY_KEY``) costs next to the unkeyed xxh3 checksum.

Rows, each keyed next to unkeyed on the same 1 MiB frames, alternated, median of several runs:

- ``frame save``: :func:`~kvdi.connectors.store.framing.frame_header` (xxh3, plus HMAC-SHA256 with a key);
- ``frame load``: :func:`~kvdi.connectors.store.framing.unframe` (xxh3 without a key, the MAC with one);
- ``cpu_offload save`` / ``load``: the whole worker half over the host pool, where hashing is most
  of the work, so the ratio is the worst case a store path sees (disk and network paths hide more).

``ratio`` is keyed throughput / unkeyed throughput: 0.5 means the keyed path takes twice as long.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvdi.bench import BenchResult
from kvdi.connectors.store.framing import FrameKey, frame_header, unframe

BLOCK = 1 << 20
FINGERPRINT = bytes(16)
NAME = bytes(range(16))  # the block key every bench frame is stored under
BENCH_KEY = "kvdi bench integrity key (not a secret)"


def _median_seconds(fns: list[Callable[[], None]], repeats: int) -> list[float]:
    """Median wall time of each ``fn``, run alternately so drift hits all alike (one warm-up each)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _row(metric: str, nbytes: int, keyed_s: float, plain_s: float, note: str) -> BenchResult:
    keyed, plain = round(nbytes / keyed_s / 1e9, 3), round(nbytes / plain_s / 1e9, 3)
    ratio = round(keyed / plain, 3) if plain else 0.0  # of the figures shown, so the row reads consistently
    return BenchResult("integrity", metric, "GB/s", keyed, plain, "unkeyed xxh3 checksum", ratio, None, note)


def bench_frames(num_blocks: int, repeats: int) -> list[BenchResult]:
    """Framing alone: header on save, verification on load, keyed next to unkeyed."""
    key = FrameKey(BENCH_KEY.encode())
    payloads = [os.urandom(BLOCK) for _ in range(num_blocks)]
    plain = [frame_header(FINGERPRINT, p, name=NAME) + p for p in payloads]
    keyed = [frame_header(FINGERPRINT, p, key, name=NAME) + p for p in payloads]

    def save(k: FrameKey | None) -> Callable[[], None]:
        def run() -> None:
            for p in payloads:
                frame_header(FINGERPRINT, p, k, name=NAME)

        return run

    def load(frames: list[bytes], k: FrameKey | None) -> Callable[[], None]:
        def run() -> None:
            for f in frames:
                unframe(f, FINGERPRINT, BLOCK, k, name=NAME)

        return run

    ks, ps, kl, pl = _median_seconds([save(key), save(None), load(keyed, key), load(plain, None)], repeats)
    note = f"HMAC-SHA256 vs xxh3_64; median of {repeats}; {num_blocks} x 1 MiB; one thread"
    nbytes = num_blocks * BLOCK
    return [_row("frame save", nbytes, ks, ps, note), _row("frame load", nbytes, kl, pl, note)]


def bench_cpu_offload(num_blocks: int, repeats: int) -> list[BenchResult]:
    """The cpu_offload worker half with and without a key: the store path where hashing weighs most."""
    from kvdi.bench.storage import _Setup

    with tempfile.TemporaryDirectory(prefix="kvdi-bench-integrity-") as name:
        keyed = _Setup("cpu_offload", num_blocks, Path(name), integrity_key=BENCH_KEY)
        plain = _Setup("cpu_offload", num_blocks, Path(name))
        try:
            ks, ps, kl, pl = _median_seconds([keyed.save, plain.save, keyed.load, plain.load], repeats)
        finally:
            keyed.close()
            plain.close()
    note = f"whole worker half, host pool; median of {repeats}; {num_blocks} x 1 MiB blocks"
    return [_row("cpu_offload save", plain.nbytes, ks, ps, note), _row("cpu_offload load", plain.nbytes, kl, pl, note)]


def run(quick: bool) -> list[BenchResult]:
    """Keyed-MAC cost as ratios: 16 blocks x 5 runs when ``quick``, else 64 blocks x 9 runs."""
    num_blocks, repeats = (16, 5) if quick else (64, 9)
    return [*bench_frames(num_blocks, repeats), *bench_cpu_offload(num_blocks, repeats)]


__all__ = ["bench_cpu_offload", "bench_frames", "run"]
