"""Benchmark: the compression codecs on KV written by a real vLLM (a tiny random bf16 Llama), and on synthetic bf16.

Usage (the vLLM venv, from the repository root)::

    PYTHONPATH=$PWD .venv-vllm/bin/python -m benchmarks.vllm.bench_compression [--repeats 7] [--out r.json]

One vLLM engine (in-process core, ``dtype=bfloat16``, a random Llama written with transformers at run
time) prefills ``--prompts`` random prompts and stores their KV through kvdi's ``shared_storage`` to a
folder. The stored frames are then re-framed per codec as a network store would
(:class:`~kvdi.connectors.store.codec.Compressor`) and read back (:func:`~kvdi.connectors.store.codec.unframe_into`,
every frame checked, every block compared byte for byte with what vLLM stored). Per codec: the ratio
(payload bytes / stored payload bytes) and compress / decompress MB/s of payload, one thread; the codecs
run alternated, ``--repeats`` times, median [min-max]. ``auto`` is shown three ways: before any link
measurement (the 10 % sample rule), and told a 100 MB/s and a 10 GB/s write link (its decision then).
The same for synthetic bf16 KV (``0.05 x randn``, the ``kvdi bench`` rows' data) in blocks of the same size.

A benchmark, not a test: it is kept out of CI. Greedy tokens are not compared here (one engine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvdi.connectors.store.codec import Compressor, unframe_into
from kvdi.connectors.store.framing import HEADER_SIZE, frame_header

CODECS: dict[str, tuple[str, float | None]] = {
    "zstd": ("zstd", None),
    "zstd-split": ("zstd-split", None),
    "auto (unmeasured link)": ("auto", None),
    "auto (100 MB/s link)": ("auto", 100e6),
    "auto (10 GB/s link)": ("auto", 10e9),
}
Block = tuple[bytes, bytes, bytes]  # key, header, payload


def vllm_blocks(work: Path, prompts: int, length: int) -> list[Block]:
    """Run one engine that stores ``prompts`` prompts' KV to a shared_storage folder; return the stored frames."""
    from tests.real_vllm.vllm_support import IN_PROCESS, kv_config, make_prompts, make_tiny_llama, run_engine

    model = make_tiny_llama(work / "model", layers=4, hidden=256, heads=4, kv_heads=2)
    store = work / "store"
    spec = {
        "model": str(model),
        "prompts": make_prompts(prompts, length, seed=1),
        "max_tokens": 1,
        "block_size": 32,
        "max_model_len": max(512, length + 8),
        "dtype": "bfloat16",
        "kv": kv_config("shared_storage", shared_storage__path=str(store)),
    }
    started = time.perf_counter()
    run_engine(work, "store", spec, env={**IN_PROCESS, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    print(f"engine stored its KV in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    blocks = []
    for path in sorted(p for p in store.rglob("*") if p.is_file() and not p.name.startswith(".")):
        data = path.read_bytes()
        if len(data) > HEADER_SIZE and data[:4] == b"KVDI":  # the name field holds the 16-byte block key
            blocks.append((data[24:40], data[:HEADER_SIZE], data[HEADER_SIZE:]))
    if not blocks:
        raise RuntimeError(f"bench: the engine stored nothing under {store}")
    return blocks


def synthetic_blocks(count: int, nbytes: int, fingerprint: bytes) -> list[Block]:
    """``count`` blocks of bf16 ``0.05 x randn`` (seeded), framed like stored ones."""
    import torch

    gen = torch.Generator().manual_seed(0)
    blocks = []
    for i in range(count):
        payload = (torch.randn(nbytes // 2, generator=gen) * 0.05).to(torch.bfloat16).view(torch.uint8).numpy()
        key = i.to_bytes(16, "little")
        raw = payload.tobytes()
        blocks.append((key, frame_header(fingerprint, raw, name=key), raw))
    return blocks


def measure(blocks: list[Block], repeats: int) -> list[dict[str, Any]]:
    """Per codec: ratio, compress and decompress MB/s (median and spread over alternated repeats)."""
    raw = sum(len(p) for _, _, p in blocks)
    times: dict[str, dict[str, list[float]]] = {c: {"compress": [], "decompress": []} for c in CODECS}
    stored: dict[str, int] = {}
    decisions: dict[str, str] = {}
    names = list(CODECS)
    for i in range(repeats + 1):  # round 0 warms up
        for name in names if i % 2 == 0 else names[::-1]:
            mode, link = CODECS[name]
            compressor = Compressor(mode, element_bytes=2)  # type: ignore[arg-type]
            if link is not None:
                compressor.link_sample(int(link), 1.0)
            start = time.perf_counter()
            frames = [b"".join(compressor.frame(key, [header, payload])) for key, header, payload in blocks]
            took = time.perf_counter() - start
            out = bytearray(len(blocks[0][2]))
            start = time.perf_counter()
            for (key, header, payload), frame in zip(blocks, frames, strict=True):
                unframe_into(frame, [memoryview(out)], header[8:24], len(payload), name=key)
            took_back = time.perf_counter() - start
            for (key, header, payload), frame in zip(blocks, frames, strict=True):  # outside the timing: all exact
                back = bytearray(len(payload))
                unframe_into(frame, [memoryview(back)], header[8:24], len(payload), name=key)
                if bytes(back) != payload:
                    raise RuntimeError(f"bench: codec {name} did not give back the stored bytes")
            if i:
                times[name]["compress"].append(took)
                times[name]["decompress"].append(took_back)
            stored[name] = sum(len(f) - HEADER_SIZE for f in frames)
            if compressor.rule is not None:
                decisions[name] = compressor.rule.snapshot().describe()
    rows = []
    for name in names:
        row: dict[str, Any] = {"codec": name, "ratio": raw / stored[name], "raw_mib": raw / (1 << 20)}
        for op in ("compress", "decompress"):
            speeds = [raw / t / 1e6 for t in times[name][op]]
            row[f"{op}_mbs"] = statistics.median(speeds)
            row[f"{op}_span"] = (min(speeds), max(speeds))
        row["auto"] = decisions.get(name, "")
        rows.append(row)
    return rows


def table(title: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"### {title}", "", "| codec | ratio | compress MB/s | decompress MB/s |", "|---|---|---|---|"]
    for r in rows:
        c, d = r["compress_span"], r["decompress_span"]
        lines.append(
            f"| {r['codec']} | {r['ratio']:.3f}x | {r['compress_mbs']:.0f} [{c[0]:.0f}-{c[1]:.0f}] "
            f"| {r['decompress_mbs']:.0f} [{d[0]:.0f}-{d[1]:.0f}] |"
        )
    lines += ["", *[f"- {r['codec']}: {r['auto']}" for r in rows if r["auto"]], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts the engine stores (default 8)")
    p.add_argument("--length", type=int, default=256, help="tokens per prompt (default 256)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per codec, alternated (default 7)")
    p.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvdi-bench-compression-") as tmp:
        real = vllm_blocks(Path(tmp), args.prompts, args.length)
    block_bytes = len(real[0][2])
    synthetic = synthetic_blocks(len(real), block_bytes, real[0][1][8:24])
    result = {
        "blocks": len(real),
        "block_bytes": block_bytes,
        "vllm": measure(real, args.repeats),
        "synthetic": measure(synthetic, args.repeats),
    }
    what = f"{len(real)} blocks x {block_bytes >> 10} KiB, median [min-max] of {args.repeats}, one thread"
    print(table(f"KV written by vLLM (tiny random bf16 Llama), {what}", result["vllm"]))
    print(table(f"synthetic bf16 (0.05 x randn), {what}", result["synthetic"]))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
