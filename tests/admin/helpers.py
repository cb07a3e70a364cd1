"""Objects for the store administration tests: valid frames and canonical sections written through kvdi's real
stores, and corrupt ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvdi.connectors.store.canonical import Geometry, RankPart
from kvdi.connectors.store.canonical_io import CanonicalRank
from kvdi.connectors.store.framing import HEADER_SIZE, FrameKey, frame_header
from kvdi.connectors.store.protocol import BlockStore

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINTS = (bytes(range(16)), bytes(range(16, 32)))  # two layouts: a fleet's store holds several models


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def frame(i: int, size: int = 256, name: int | None = None) -> bytes:
    """A valid frame for the object named ``key(name)`` (default ``key(i)``); layouts alternate between two
    fingerprints."""
    payload = bytes([i % 251]) * size
    return frame_header(FINGERPRINTS[i % 2], payload, name=key(i if name is None else name)) + payload


CORRUPT_FIRST = 1000  # corruptions() are stored as key(1000), key(1001), ... in their order


def corruptions() -> dict[str, bytes]:
    """Bad objects by the reason ``verify`` must give for each; the i-th is stored as ``key(CORRUPT_FIRST + i)``."""
    flipped = bytearray(frame(99, name=CORRUPT_FIRST))
    flipped[HEADER_SIZE + 5] ^= 0x40
    return {
        "checksum": bytes(flipped),
        "magic": b"XXXX" + frame(99, name=CORRUPT_FIRST + 1)[4:],
        "length": frame(99, name=CORRUPT_FIRST + 2)[:-10],  # truncated
        "name": frame(99),  # a valid frame of key(99), copied under key(1003)
    }


def kvdi(*args: str, env: dict[str, str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``kvdi`` of this checkout with a clean KVDI_* environment plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVDI_")}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-m", "kvdi.cli", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        input=stdin,
    )


A = Geometry("model-a", 2, 2, 8, 4, "float16", section_layers=1)  # 4 canonical sections a block
B = Geometry("model-b", 2, 2, 8, 4, "float16")  # 2 sections a block (all layers, one head each)
BLOCKS_A = [bytes([0xA0 + i]) * 16 for i in range(4)]
BLOCKS_B = [bytes([0xB0 + i]) * 16 for i in range(2)]
FP_A, FP_B = A.fingerprint().hex(), B.fingerprint().hex()


def layers(g: Geometry, seed: int, heads: int = 0) -> list[bytes]:
    """One block of ``heads`` KV heads (0: all) of the model, one buffer per layer (kvdi's order)."""
    size = 2 * g.block_size * (heads or g.num_kv_heads) * g.head_dim * g.elem_bytes
    return [bytes((seed * 7 + layer * 3 + i) % 251 for i in range(size)) for layer in range(g.num_layers)]


def write_sections(
    store: BlockStore, g: Geometry, blocks: list[bytes], frame_key: FrameKey | None = None, tp: int = 2
) -> None:
    """Every canonical section of ``blocks`` written by kvdi's canonical writer: TP=``tp`` ranks of the whole
    model, each one pack a block and layer section (with ``tp`` = the model's 2 KV heads: one section a pack)."""
    for r in range(tp):
        part = RankPart.of(g, tp, r)
        rank = CanonicalRank(store, g, part, key=frame_key)
        written = rank.save([(k, layers(g, i * tp + r, part.head_count)) for i, k in enumerate(blocks)])
        assert written == len(blocks) * len(rank.packs)
