"""``kvdi bench async_transfers``: the measurements behind the asynchronous-transfer design.

1. Per 512 KiB block on shared_storage (a folder under $TMPDIR): copying the block out of
   the cache into an owned buffer (what a copy-out design adds on the engine thread) vs
   framing and writing it (what a synchronous save costs the engine thread).
2. The reference engine with ``shared_storage``: storing rounds (new prompts each round),
   engines with ``transfer.async_save`` on and off alternated, round time and time to first
   token (medians), the engine thread's time in ``wait_for_save`` per round, plus a
   no-connector engine.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvdi.bench import BenchResult

MODEL: dict[str, Any] = {
    "model_id": "kvdi-bench-async",
    "num_layers": 8,
    "hidden_size": 256,
    "num_heads": 8,
    "num_kv_heads": 8,
    "head_dim": 64,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "max_model_len": 2048,
}  # 16-token blocks of 8 layers x 2 x 8 heads x 64 x fp32 = 512 KiB


def block_costs(tmp: Path, n: int = 200) -> dict[str, float]:
    from kvdi.connectors.shared_storage import FileBlockStore
    from kvdi.connectors.store.framing import frame_header
    from kvdi.layout import KVCacheSpec

    layout = KVCacheSpec("b", 8, 8, 64, 16, "float32")
    cache = [np.random.default_rng(l).random((n, layout.layer_block_bytes // 8)).view(np.uint8) for l in range(8)]  # noqa: E741
    owned = np.empty((layout.block_bytes,), dtype=np.uint8)
    store = FileBlockStore(tmp / "blocks")
    copy, write = [], []
    for b in range(n):
        t0 = time.perf_counter()
        off = 0
        for layer in cache:
            np.copyto(owned[off : off + layer.shape[1]], layer[b])
            off += layer.shape[1]
        t1 = time.perf_counter()
        pieces = [memoryview(layer[b]) for layer in cache]
        store.put_many(
            [(b.to_bytes(16, "big"), [frame_header(layout.fingerprint(), pieces, name=b.to_bytes(16, "big")), *pieces])]
        )
        t2 = time.perf_counter()
        copy.append(t1 - t0)
        write.append(t2 - t1)
    return {"copy_ms": 1e3 * statistics.median(copy), "frame_write_ms": 1e3 * statistics.median(write)}


def engine_rounds(tmp: Path, rounds: int) -> dict[str, dict[str, float]]:
    from kvdi.containers import build_engine_container

    rng = random.Random(0)
    common: dict[str, Any] = {"model": MODEL, "allocator": {"device": "cpu", "num_blocks": 160}}
    configs: dict[str, dict[str, Any]] = {
        "none": {"kv_connector": "null"},
        "sync": {"kv_connector": "shared_storage", "transfer": {"async_save": False}},
        "async": {"kv_connector": "shared_storage", "transfer": {"async_save": True}},
    }
    engines = {}
    for name, extra in configs.items():
        store = {"shared_storage": {"path": str(tmp / name)}}
        kwargs: dict[str, Any] = {**common, **extra, **store}
        engines[name] = build_engine_container(**kwargs)
    times: dict[str, list[float]] = {n: [] for n in configs}
    ttft: dict[str, list[float]] = {n: [] for n in configs}
    save: dict[str, list[float]] = {n: [] for n in configs}
    for r in range(rounds + 1):
        prompts = [[rng.randrange(1024) for _ in range(97)] for _ in range(6)]  # 6 blocks each: 3 MiB per prompt
        for name in configs if r % 2 else reversed(list(configs)):
            engine = engines[name].engine()
            before = engine.connector_stats().worker.save_seconds
            t0 = time.perf_counter()
            outs = engine.generate(prompts, 4)
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
                save[name].append(engine.connector_stats().worker.save_seconds - before)
                ttft[name].extend(o.time_to_first_token_s or 0.0 for o in outs)
    for container in engines.values():
        container.engine().shutdown()
        container.shutdown_resources()
    return {
        n: {
            "round_ms": 1e3 * statistics.median(times[n]),
            "ttft_ms": 1e3 * statistics.median(ttft[n]),
            "wait_for_save_ms_per_round": 1e3 * statistics.median(save[n]),
        }
        for n in configs
    }


def run(quick: bool) -> list[BenchResult]:
    """Copy-out vs write per block; storing rounds of the reference engine, async vs sync saves vs no connector."""
    rounds = 3 if quick else 9
    with tempfile.TemporaryDirectory(prefix="kvdi-bench-async-") as name:
        tmp = Path(name)
        block = block_costs(tmp, 50 if quick else 200)
        eng = engine_rounds(tmp, rounds)
    note = f"reference engine, shared_storage, 6 new 97-token prompts a round, medians of {rounds} alternated rounds"
    return [
        BenchResult(
            "async_transfers",
            "copy a 512 KiB block out vs frame+write it",
            "ms",
            block["copy_ms"],
            block["frame_write_ms"],
            "frame+write",
            block["copy_ms"] / block["frame_write_ms"],
            note="why CPU caches are read in place: holding beats both",
            higher_is_better=False,
        ),
        BenchResult(
            "async_transfers",
            "engine thread in wait_for_save per round",
            "ms",
            eng["async"]["wait_for_save_ms_per_round"],
            eng["sync"]["wait_for_save_ms_per_round"],
            "sync saves",
            eng["async"]["wait_for_save_ms_per_round"] / eng["sync"]["wait_for_save_ms_per_round"],
            note=note,
            higher_is_better=False,
        ),
        BenchResult(
            "async_transfers",
            "time to first token, storing round",
            "ms",
            eng["async"]["ttft_ms"],
            eng["none"]["ttft_ms"],
            "null connector",
            eng["async"]["ttft_ms"] / eng["none"]["ttft_ms"],
            target=1.05,
            note=note,
            higher_is_better=False,
        ),
        BenchResult(
            "async_transfers",
            "storing round (generate returns after held blocks are written)",
            "ms",
            eng["async"]["round_ms"],
            eng["none"]["round_ms"],
            "null connector",
            eng["async"]["round_ms"] / eng["none"]["round_ms"],
            note=note,
            higher_is_better=False,
        ),
    ]
