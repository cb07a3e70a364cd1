"""Where a store's time goes, per block: open, stat, read/write, checksum, MAC, copy, rename, fsync, Python.

Runs kvdi's real worker half (built by the container, as ``kvdi bench storage`` does) over
cpu_offload and shared_storage, with the system calls, hashes and copies it makes wrapped by
timers, and prints microseconds per 1 MiB block for each kind of work; ``python`` is what is
left (interpreter, bookkeeping), with the timers' own cost taken out. One command::

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.profile_stores            # 64 blocks x 5 runs
    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.profile_stores --key --json

``--key`` sets an integrity key (frames carry an HMAC-SHA256), ``--json`` prints JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from kvdi.bench.storage import _objects, _remove_objects, _Setup, evict_from_page_cache
from kvdi.connectors import cpu_offload
from kvdi.connectors.store import blockio

KINDS = {
    "open": [(os, "open")],
    "stat": [(os, "fstat"), (os, "stat")],
    "read": [(os, "readv"), (os, "preadv"), (os, "read")],
    "write": [(os, "writev"), (os, "pwritev"), (os, "write")],
    "close": [(os, "close")],
    "rename": [(os, "replace"), (os, "rename")],
    "touch (utime)": [(os, "utime")],
    "fsync": [(os, "fsync"), (os, "fdatasync")],
    "readahead hint": [(os, "posix_fadvise")],
    "checksum": [(xxhash, "xxh3_64_intdigest"), (xxhash, "xxh3_64")],
    "MAC": [(hmac, "new")],
    "copy": [(np, "copyto"), (torch.Tensor, "copy_"), (blockio, "scatter"), (cpu_offload, "gather")],
}


class Timers:
    """Per-kind seconds and call counts; wraps callables while active."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                out = fn(*args, **kwargs)
            finally:
                seconds[kind] += clock() - start
                calls[kind] += 1
            if kind in ("checksum", "MAC") and hasattr(out, "update"):
                return _TimedHasher(out, self, kind)
            return out

        return timed

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        saved = []
        for kind, targets in KINDS.items():
            for owner, name in targets:
                original = getattr(owner, name, None)
                if original is None:
                    continue
                saved.append((owner, name, original))
                setattr(owner, name, self.wrap(kind, original))
        try:
            yield
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)


class _TimedHasher:
    """A streaming hasher whose ``update`` / ``digest`` count toward its kind."""

    def __init__(self, inner: Any, timers: Timers, kind: str) -> None:
        self._inner, self._timers, self._kind = inner, timers, kind

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        return self._timers.wrap(self._kind, attr) if callable(attr) else attr


def timer_cost() -> float:
    """Seconds one timer wrapper adds to a call (subtracted from ``python``)."""
    t = Timers()
    f = t.wrap("x", int)
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        f()
    wrapped = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n):
        pass
    return max(0.0, (wrapped - (time.perf_counter() - start)) / n)


def profile(name: str, op: Callable[[], None], prepare: Callable[[], None], blocks: int, runs: int) -> dict[str, Any]:
    prepare()
    op()  # warm-up
    timers, total = Timers(), 0.0
    for _ in range(runs):
        prepare()
        with timers.active():
            start = time.perf_counter()
            op()
            total += time.perf_counter() - start
    per = 1e6 / (blocks * runs)
    calls = sum(timers.calls.values())
    measured = sum(timers.seconds.values())
    python = max(0.0, total - measured - calls * timer_cost())
    row = {kind: round(timers.seconds.get(kind, 0.0) * per, 1) for kind in KINDS}
    row["python"] = round(python * per, 1)
    return {"case": name, "total_us_per_block": round(total * per, 1), "us_per_block": row,
            "calls_per_block": round(calls / (blocks * runs), 1)}  # fmt: skip


def run(blocks: int, runs: int, key: bool) -> list[dict[str, Any]]:
    extra: dict[str, Any] = {"integrity_key": "profile-stores-key-0123456789"} if key else {}
    out = []
    with tempfile.TemporaryDirectory(prefix="kvdi-profile-") as name:
        tmp = Path(name)
        pool = _Setup("cpu_offload", blocks, tmp, **extra)
        try:
            out.append(profile("cpu_offload save", pool.save, lambda: None, blocks, runs))
            out.append(profile("cpu_offload load", pool.load, lambda: None, blocks, runs))
        finally:
            pool.close()
        files = _Setup("shared_storage", blocks, tmp, **extra)
        try:
            store = tmp / "kvdi"
            files.save()
            out.append(profile("shared_storage save", files.save, partial(_remove_objects, store), blocks, runs))
            out.append(profile("shared_storage load (warm)", files.load, lambda: None, blocks, runs))
            cold = partial(evict_from_page_cache, _objects(store))
            out.append(profile("shared_storage load (cold)", files.load, cold, blocks, runs))
        finally:
            files.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64, help="1 MiB blocks per run (default 64)")
    parser.add_argument("--runs", type=int, default=5, help="runs per case (default 5)")
    parser.add_argument("--key", action="store_true", help="frames carry a keyed MAC (KVDI_INTEGRITY_KEY)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = run(args.blocks, args.runs, args.key)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    kinds = [*KINDS, "python"]
    used = [k for k in kinds if any(r["us_per_block"][k] for r in rows)]
    print(f"µs per 1 MiB block ({args.blocks} blocks x {args.runs} runs{', keyed MAC' if args.key else ''})")
    print(f"{'case':28}{'total':>8}" + "".join(f"{k[:10]:>11}" for k in used))
    for r in rows:
        cells = "".join(f"{r['us_per_block'][k]:>11.1f}" for k in used)
        print(f"{r['case']:28}{r['total_us_per_block']:>8.1f}{cells}")


if __name__ == "__main__":
    main()
