"""S3: kvdi's worker half over the ``s3`` store next to raw boto3 ``PutObject`` / ``GetObject`` of the same bytes.

Starts moto's S3 server (``moto[server]``, the test extra; the bench is skipped without it) in
its own process on a free loopback port, so the server does not share the bench's interpreter.
The blocks are 1 MiB each (8 layers of 128 KiB); kvdi saves them through
:class:`~kvdi.connectors.store.StoreWorkerConnector` (frame header, checksum, one conditional
``PutObject`` per block on ``workers`` threads) and loads them back into a paged cache (one
ranged ``GetObject`` per block, every frame verified, payload copied into the cache). The
baseline puts the same payload bytes, already contiguous, with plain ``PutObject`` calls and
reads them with plain ``GetObject`` calls on a thread pool of the same size over one boto3
client with as many pooled connections, and does nothing with what it reads. Target: kvdi >= 0.8x.
Then the compression rows (:mod:`kvdi.bench.compression`) on the same server.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import moto.server  # noqa: F401  (the bench needs moto's server: skipped when it is missing)

from kvdi.bench import BenchResult
from kvdi.bench.compression import compression_rows
from kvdi.bench.redis import BLOCK_SIZE, MODEL, _caches, _seconds, _span, _step, _worker
from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata
from kvdi.connectors.store.keys import block_keys
from kvdi.containers import build_kv_container

TARGET = 0.8
WORKERS = 16
BUCKET = "kvdi-bench"


@contextlib.contextmanager
def _moto_process() -> Iterator[str]:
    """moto's S3 server in a child process on a free loopback port; its endpoint URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("bench: moto's S3 server did not start")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def run(quick: bool) -> list[BenchResult]:
    """Save and load GB/s through kvdi's s3 store next to raw boto3 calls; medians of alternated runs."""
    num_blocks, repeats = (32, 5) if quick else (64, 9)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "kvdi-bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "kvdi-bench")
    with _moto_process() as url:
        results = _measure(url, num_blocks, repeats)

        def settings(codec: str) -> dict[str, Any]:
            s3 = {"bucket": BUCKET, "endpoint_url": url, "workers": WORKERS, "read_timeout_s": 60.0}
            return {"kv_connector": "s3", "s3": {**s3, "key_prefix": f"kvdi-{codec}/", "compression": codec}}

        return results + compression_rows("s3", settings, num_blocks, repeats, MODEL, BLOCK_SIZE)


def _measure(url: str, num_blocks: int, repeats: int) -> list[BenchResult]:
    import boto3
    import botocore.config

    config = botocore.config.Config(
        max_pool_connections=WORKERS,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"},
    )
    client: Any = boto3.client("s3", endpoint_url=url, region_name="us-east-1", config=config)
    client.create_bucket(Bucket=BUCKET)
    s3 = {"bucket": BUCKET, "endpoint_url": url, "workers": WORKERS, "read_timeout_s": 60.0}
    container = build_kv_container(
        kv_connector="s3",
        s3=s3,
        model=MODEL,
        allocator={"device": "cpu", "num_blocks": num_blocks, "block_size": BLOCK_SIZE},
    )
    pool = ThreadPoolExecutor(WORKERS)
    try:
        layout = container.layout()
        keys = tuple(block_keys(list(range(1, num_blocks * BLOCK_SIZE + 2)), layout))
        ids = tuple(range(num_blocks))
        source = _caches(layout.layer_names, num_blocks, layout.block_shape, fill=True)
        dest = _caches(layout.layer_names, num_blocks, layout.block_shape, fill=False)
        saver, loader = _worker(container), _worker(container)
        saver.register_kv_caches(source)
        loader.register_kv_caches(dest)
        save_meta = BlockTransferMetadata(saves=(BlockTransfer("bench", ids, keys),))
        load_meta = BlockTransferMetadata(loads=(BlockTransfer("bench", ids, keys),))
        payloads = [b"".join(source[n][b].numpy().tobytes() for n in layout.layer_names) for b in range(num_blocks)]
        raw_names = [f"bench-raw/{k.hex()}" for k in keys]
        kvdi_names = [f"kvdi/{k.hex()}" for k in keys]

        def raw_save() -> None:
            pairs = zip(raw_names, payloads, strict=True)
            list(pool.map(lambda kv: client.put_object(Bucket=BUCKET, Key=kv[0], Body=kv[1]), pairs))

        def raw_load() -> None:
            list(pool.map(lambda k: client.get_object(Bucket=BUCKET, Key=k)["Body"].read(), raw_names))

        def clear(names: list[str]) -> None:
            list(pool.map(lambda k: client.delete_object(Bucket=BUCKET, Key=k), names))

        ops: dict[str, tuple[Callable[[], None], list[str] | None]] = {
            "kvdi_save": (lambda: _step(saver, save_meta), kvdi_names),
            "raw_save": (raw_save, raw_names),
            "kvdi_load": (lambda: _step(loader, load_meta), None),
            "raw_load": (raw_load, None),
        }
        for fn, _ in ops.values():  # warm up: connections, allocations
            fn()
        times: dict[str, list[float]] = {name: [] for name in ops}
        for i in range(repeats):
            order = list(ops) if i % 2 == 0 else ["raw_save", "kvdi_save", "raw_load", "kvdi_load"]
            for name in order:
                fn, names = ops[name]
                if names:
                    clear(names)  # every save starts from absent objects (kvdi's are published once)
                times[name].append(_seconds(fn))
        if any(not dest[n].equal(source[n]) for n in layout.layer_names):
            raise RuntimeError("bench: blocks loaded from s3 differ from the blocks saved")
    finally:
        pool.shutdown()
        container.shutdown_resources()
        client.close()

    total = num_blocks * layout.block_bytes
    note = (
        f"moto server (own process) on loopback; {num_blocks} blocks x {layout.block_bytes >> 20} MiB, {WORKERS} "
        f"threads each side, median of {repeats} (alternating order); kvdi = StoreWorkerConnector (frame, checksum, "
        "If-None-Match put / ranged get, copy into the paged cache)"
    )
    results = []
    for op, call in (("save", "PutObject"), ("load", "GetObject")):
        kvdi_gbs = total / statistics.median(times[f"kvdi_{op}"]) / 1e9
        raw_gbs = total / statistics.median(times[f"raw_{op}"]) / 1e9
        kvdi_span, raw_span = _span(total, times[f"kvdi_{op}"]), _span(total, times[f"raw_{op}"])
        spread = f"; spread (GB/s, min-max): kvdi {kvdi_span}, raw {raw_span}"
        results.append(
            BenchResult(
                "s3",
                f"{op} throughput",
                "GB/s",
                kvdi_gbs,
                raw_gbs,
                f"raw boto3 {call} x{WORKERS} threads",
                kvdi_gbs / raw_gbs,
                target=TARGET,
                note=note + spread,
            )
        )
    return results
