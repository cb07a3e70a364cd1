"""The canonical stored block: any TP/PP shape and block order reads what any other wrote (real files, real tensors)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store.canonical import (
    HEADER_SIZE,
    Geometry,
    RankPart,
    Section,
    frame_kind,
    frame_section,
    read_plan,
    write_plan,
)
from kvdi.connectors.store.canonical_io import CanonicalRank
from kvdi.connectors.store.framing import FrameKey, frame_header
from kvdi.errors import ConfigError

KEYS = [bytes([i]) * 16 for i in range(3)]


def geometry(heads: int = 4, layers: int = 4, section_layers: int = 0, dtype: str = "float16") -> Geometry:
    return Geometry("tiny-model", layers, heads, 8, 4, dtype, section_layers=section_layers)


def full_blocks(g: Geometry, n: int = len(KEYS), seed: int = 0) -> list[torch.Tensor]:
    """``n`` whole-model blocks ``[L, 2, H, N, D]`` of random KV."""
    gen = torch.Generator().manual_seed(seed)
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[g.dtype]
    shape = (g.num_layers, 2, g.num_kv_heads, g.block_size, g.head_dim)
    return [torch.randn(shape, generator=gen).to(dt) for _ in range(n)]


def rank_layers(full: torch.Tensor, part: RankPart, order: str) -> list[torch.Tensor]:
    """A rank's block as its engine holds it: one contiguous tensor per layer it has, in ``order``."""
    out = []
    for layer in range(part.layer_start, part.layer_start + part.layer_count):
        kvhtd = full[layer, :, part.head_start : part.head_start + part.head_count]  # [2, h, N, D]
        perm = {"": (0, 2, 1, 3), "nhc": (2, 1, 0, 3), "hnc": (1, 2, 0, 3)}[order]
        out.append(kvhtd.permute(*perm).contiguous())
    return out


def write(store: FileBlockStore, g: Geometry, parts: list[RankPart], order: str, fulls: list[torch.Tensor]) -> int:
    written = 0
    for part in parts:
        rank = CanonicalRank(store, g, part, order)
        written += rank.save([(k, rank_layers(f, part, order)) for k, f in zip(KEYS, fulls, strict=True)])
    return written


def read(store: FileBlockStore, g: Geometry, part: RankPart, order: str) -> tuple[CanonicalRank, int, list]:
    rank = CanonicalRank(store, g, part, order)
    dst = [[torch.zeros_like(t) for t in rank_layers(full, part, order)] for full in full_blocks(g)]
    n = rank.load(list(zip(KEYS, dst, strict=True)))
    return rank, n, dst


def tp(g: Geometry, size: int, layers: tuple[int, int] | None = None) -> list[RankPart]:
    return [RankPart.of(g, size, r, layers) for r in range(size)]


@pytest.fixture
def store(tmp_path: Path) -> FileBlockStore:
    s = FileBlockStore(tmp_path / "kv")
    yield s
    s.close()


def stored(store: FileBlockStore) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in store.root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(("w_order", "r_order"), [("nhc", "hnc"), ("", "nhc"), ("hnc", "")])
def test_tp1_writes_tp2_ranks_read_exactly_their_heads(store: FileBlockStore, w_order: str, r_order: str) -> None:
    g = geometry()
    fulls = full_blocks(g)
    assert write(store, g, tp(g, 1), w_order, fulls) == len(KEYS)  # one pack a block: its 4 sections (one a head)
    assert len(stored(store)) == len(KEYS)
    for part in tp(g, 2):
        rank, n, dst = read(store, g, part, r_order)
        assert n == len(KEYS) and rank.loaded_blocks == len(KEYS) and not rank.misses
        assert [s.head_start for s in rank.reads] == list(range(part.head_start, part.head_start + 2))
        assert rank.read_bytes == len(KEYS) * 2 * rank.object_bytes()  # only its own heads' sections of each pack
        for full, layers in zip(fulls, dst, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(layers, rank_layers(full, part, r_order), strict=True))


def test_tp2_writes_tp1_reads_the_union(store: FileBlockStore) -> None:
    g = geometry(dtype="bfloat16")
    fulls = full_blocks(g)
    write(store, g, tp(g, 2), "nhc", fulls)
    (part,) = tp(g, 1)
    rank, n, dst = read(store, g, part, "hnc")
    assert n == len(KEYS) and not rank.misses
    for full, layers in zip(fulls, dst, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(layers, rank_layers(full, part, "hnc"), strict=True))


def test_pp2_writes_tp2_reads(store: FileBlockStore) -> None:
    g = geometry(section_layers=2)
    fulls = full_blocks(g)
    write(store, g, [RankPart.of(g, 1, 0, (0, 2)), RankPart.of(g, 1, 0, (2, 2))], "nhc", fulls)
    for part in tp(g, 2):
        rank, n, dst = read(store, g, part, "nhc")
        assert n == len(KEYS) and not rank.misses
        assert {(s.layer_start, s.head_start) for s in rank.reads} == {
            (lo, h) for lo in (0, 2) for h in range(part.head_start, part.head_start + 2)
        }
        for full, layers in zip(fulls, dst, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(layers, rank_layers(full, part, "nhc"), strict=True))


def test_gqa_tp2_writer_stores_what_a_tp1_writer_stores(tmp_path: Path) -> None:
    g = geometry(heads=1)
    fulls = full_blocks(g)
    one, two = FileBlockStore(tmp_path / "tp1"), FileBlockStore(tmp_path / "tp2")
    assert [p.write_count for p in tp(g, 2)] == [1, 0]  # both hold head 0; the lowest rank writes it
    assert write(one, g, tp(g, 1), "nhc", fulls) == write(two, g, tp(g, 2), "hnc", fulls) == len(KEYS)
    bytes1, bytes2 = stored(one), stored(two)
    assert bytes1 == bytes2 and sum(map(len, bytes1.values())) == len(KEYS) * (HEADER_SIZE + 2 * 4 * 4 * 8 * 2)
    for part in tp(g, 2):  # every replica holder reads the one copy
        _, n, dst = read(two, g, part, "nhc")
        assert n == len(KEYS)
        assert all(torch.equal(a, b) for a, b in zip(dst[0], rank_layers(fulls[0], part, "nhc"), strict=True))
    one.close()
    two.close()


def test_a_corrupted_section_is_a_counted_miss_for_every_rank_needing_it(store: FileBlockStore) -> None:
    g = geometry(heads=1)
    write(store, g, tp(g, 1), "nhc", full_blocks(g))
    path = store.path_for(Section(0, 4, 0, 1).key(KEYS[1]))
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 5] ^= 0x40
    path.write_bytes(bytes(raw))
    for part in tp(g, 2):
        rank, n, dst = read(store, g, part, "nhc")
        assert n == 1 and rank.loaded_blocks == 1
        assert rank.misses["checksum"] + rank.misses["absent"] == 1 and rank.misses["blocks"] == 2
        assert all(not t.any() for t in dst[1])  # nothing of the bad block landed


def test_a_missing_section_misses_only_where_needed(store: FileBlockStore) -> None:
    g = geometry()
    write(store, g, tp(g, 2), "nhc", full_blocks(g))
    os.unlink(store.path_for(Section(0, 4, 2, 2).key(KEYS[0])))  # heads 2-3: TP=2 rank 1's pack
    r0, n0, _ = read(store, g, RankPart.of(g, 2, 0), "nhc")
    r1, n1, _ = read(store, g, RankPart.of(g, 2, 1), "nhc")
    whole, nw, _ = read(store, g, RankPart.of(g, 1, 0), "nhc")
    assert (n0, n1, nw) == (3, 0, 0)
    assert r1.misses["absent"] == 1 and whole.misses["absent"] == 1 and not r0.misses


def test_old_per_rank_frames_are_counted_misses_never_loaded(store: FileBlockStore) -> None:
    g = geometry(heads=1)
    section = Section(0, 4, 0, 1)
    name = section.key(KEYS[0])
    payload = bytes(g.section_bytes(section))
    old = frame_header(bytes(16), payload, name=name) + payload  # a valid per-rank frame, under a canonical name
    store.put_many([(name, [old])])
    assert frame_kind(old) == "per_rank"
    rank, n, _ = read(store, g, RankPart.of(g), "nhc")
    assert n == 0 and rank.misses["old_format"] == 1


def test_a_mac_reader_refuses_unkeyed_and_other_keys(store: FileBlockStore) -> None:
    g = geometry(heads=2)
    fulls = full_blocks(g)
    (part,) = tp(g, 1)
    writer = CanonicalRank(store, g, part, "nhc", FrameKey(b"k" * 32))
    writer.save([(k, rank_layers(f, part, "nhc")) for k, f in zip(KEYS, fulls, strict=True)])
    good = CanonicalRank(store, g, part, "nhc", FrameKey(b"k" * 32))
    dst = [rank_layers(torch.zeros_like(fulls[0]), part, "nhc")]
    assert good.load([(KEYS[0], dst[0])]) == 1
    assert torch.equal(dst[0][1], rank_layers(fulls[0], part, "nhc")[1])
    other = CanonicalRank(store, g, part, "nhc", FrameKey(b"x" * 32))
    assert other.load([(KEYS[1], dst[0])]) == 0 and other.misses["mac"] == 1


def test_fingerprint_names_no_shape_but_every_geometry_field() -> None:
    g = geometry()
    assert Geometry("tiny-model", 4, 4, 8, 4, "float16").fingerprint() == g.fingerprint()
    others = [geometry(dtype="float32"), geometry(section_layers=2), geometry(heads=2), geometry(layers=2)]
    assert len({o.fingerprint() for o in others} | {g.fingerprint()}) == len(others) + 1


def test_plans_and_refusals() -> None:
    g = geometry(section_layers=2)
    assert len(write_plan(g, RankPart.of(g, 1, 0, (0, 2)))) == 4
    assert len(read_plan(g, RankPart.of(g, 1, 0, (1, 2)))) == 8  # straddles both layer sections: reads both
    with pytest.raises(ConfigError, match="not whole sections"):
        write_plan(g, RankPart.of(g, 1, 0, (1, 2)))
    with pytest.raises(ValueError, match="section_layers=3"):
        geometry(section_layers=3)
    with pytest.raises(ValueError, match="tp_size=3"):
        RankPart.of(g, 3, 0)
    with pytest.raises(ValueError, match="order='xyz'"):
        CanonicalRank(FileBlockStore(Path("/nonexistent")), g, RankPart.of(g), "xyz")


class Kept:
    """A store double keeping what ``put_many`` was given (each pack's pieces, joined)."""

    def __init__(self) -> None:
        self.items: dict[bytes, bytes] = {}

    def put_many(self, items: list[tuple[bytes, list[bytes]]]) -> int:
        self.items.update((name, b"".join(bytes(memoryview(p).cast("B")) for p in pieces)) for name, pieces in items)
        return len(items)


@pytest.mark.parametrize("order", ["hnc", "nhc"])
@pytest.mark.parametrize("key", [None, FrameKey(b"k" * 32)])
def test_packs_framed_in_one_pass_are_what_frame_section_writes(order: str, key: FrameKey | None) -> None:
    """An unkeyed pack's headers are built in one pass from templates; each is byte for byte the header
    frame_section makes of that section and payload (keyed packs take frame_section itself)."""
    g = geometry(heads=4)
    for part in tp(g, 2):
        kept = Kept()
        rank = CanonicalRank(kept, g, part, order, key)  # type: ignore[arg-type]
        assert rank.save([(k, rank_layers(f, part, order)) for k, f in zip(KEYS, full_blocks(g), strict=True)]) == 3
        assert len(kept.items) == 3
        for block_key in KEYS:
            (span,) = rank.packs
            name = span.pack.key(block_key)
            pack, at = kept.items[name], 0
            for section in rank.writes:
                n = g.section_bytes(section)
                header, payload = pack[at : at + HEADER_SIZE], pack[at + HEADER_SIZE : at + HEADER_SIZE + n]
                assert header == frame_section(g, section, payload, key, name=name)
                at += HEADER_SIZE + n
            assert at == len(pack)
