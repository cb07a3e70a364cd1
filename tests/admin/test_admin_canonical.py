"""``kvdi store stats|verify|clear`` on canonical sections (issue 30 item 4), real files and a real redis-server.

Sections are written by kvdi's own canonical writer (:class:`CanonicalRank`) for two models, beside
per-rank frames; one section of each of model A's blocks is then damaged in a way a load refuses
(checksum, length, range, header), one of model B's is turned into format version 1, and three
foreign entries are planted: a valid section copied under another name, a bare ``KVDC`` magic, and
another application's file. ``verify`` must report exactly what a load counts as misses,
``clear`` remove sections by model and never a foreign entry, ``stats`` tell the formats apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from kvdi.admin import Selection, clear_store, open_admin, store_stats, verify_store
from kvdi.cli import main
from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store.canonical import HEADER_SIZE, MAGIC, Geometry, RankPart, frame_section
from kvdi.connectors.store.canonical_io import CanonicalRank
from kvdi.connectors.store.framing import FrameKey
from kvdi.connectors.store.protocol import BlockStore
from kvdi.settings import load_settings
from kvdi.testing.redis_server import RedisServer
from tests.admin.helpers import BLOCKS_A, BLOCKS_B, FINGERPRINTS, FP_A, FP_B, A, B, frame, key, kvdi, write_sections

OTHER_APP = hashlib.md5(b"user:1").hexdigest()
Get = Callable[[bytes], bytes]
Put = Callable[[bytes, bytes], None]


def flip(data: bytearray) -> bytearray:
    data[HEADER_SIZE + 3] ^= 1  # one payload bit
    return data


def damage(get: Get, put: Put) -> dict[str, str]:
    """One section of each of A's blocks made bad, one of B's made version 1; the reasons a load gives, by name."""
    expected: dict[str, str] = {}

    def patch(name: bytes, reason: str, edit: Callable[[bytearray], bytes | bytearray]) -> None:
        put(name, bytes(edit(bytearray(get(name)))))
        expected[name.hex()] = reason

    sections = A.sections()
    patch(sections[0].key(BLOCKS_A[0]), "checksum", flip)
    patch(sections[1].key(BLOCKS_A[1]), "length", lambda d: d[:-10])  # truncated
    patch(sections[2].key(BLOCKS_A[2]), "range", lambda d: d[:44] + (3).to_bytes(4, "little") + d[48:])
    patch(sections[3].key(BLOCKS_A[3]), "header", lambda d: d[:6] + bytes([d[6] | 4]) + d[7:])  # undefined flag
    patch(B.sections()[0].key(BLOCKS_B[0]), "version", lambda d: d[:4] + (1).to_bytes(2, "little") + d[6:])
    return expected


FOREIGN = {key(3000).hex(): "section of another name", key(3001).hex(): "no frame header", OTHER_APP: "no frame header"}


def plant(store: BlockStore, get: Get, put: Put) -> dict[str, str]:
    """The store described above; the bad sections' reasons by name."""
    write_sections(store, A, BLOCKS_A)
    write_sections(store, B, BLOCKS_B)
    assert store.put_many([(key(i), [frame(i)]) for i in range(4)]) == 4  # per-rank frames of two layouts
    put(key(3000), get(A.sections()[0].key(BLOCKS_A[1])))  # a valid section copied under another name
    put(key(3001), MAGIC + bytes(40))
    put(bytes.fromhex(OTHER_APP), b"another application's value")
    return damage(get, put)


def file_io(root: Path) -> tuple[Get, Put]:
    def path(name: bytes) -> Path:
        return root / name.hex()[:2] / name.hex()

    def put(name: bytes, data: bytes) -> None:
        path(name).parent.mkdir(exist_ok=True)
        path(name).write_bytes(data)

    return (lambda name: path(name).read_bytes()), put


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "kv"
    files = FileBlockStore(root)
    try:
        expected = plant(files, *file_io(root))
    finally:
        files.close()
    return root, expected


def env(root: Path) -> dict[str, str]:
    return {"KVDI_KV_CONNECTOR": "shared_storage", "KVDI_SHARED_STORAGE__PATH": str(root)}


FORMATS = {"per_rank": 4, "canonical": 19, "canonical_v1": 1}


def test_stats_tells_per_rank_frames_sections_old_versions_and_foreign_entries_apart(
    store: tuple[Path, dict[str, str]],
) -> None:
    admin = open_admin(load_settings(shared_storage={"path": store[0]}))
    try:
        stats = store_stats(admin)
    finally:
        admin.close()
    assert {name: g.objects for name, g in stats.formats.items()} == FORMATS
    assert {name: g.objects for name, g in stats.groups.items()} == {
        FINGERPRINTS[0].hex(): 2,
        FINGERPRINTS[1].hex(): 2,
        f"canonical:{FP_A}": 16,
        f"canonical:{FP_B}": 3,
        f"canonical_v1:{FP_B}": 1,
    }
    assert stats.total.objects == 24 and stats.foreign == len(FOREIGN) and stats.odd == 0


def test_verify_reports_exactly_what_a_load_counts_as_misses(store: tuple[Path, dict[str, str]]) -> None:
    """verify names the damaged sections with the reasons a canonical load gives them; after the load (which
    discards what it refuses) verify finds nothing bad left: the same set, checked the same way."""
    root, expected = store
    admin = open_admin(load_settings(shared_storage={"path": root}))
    try:
        report = verify_store(admin)
        assert {b.name: b.reason for b in report.bad} == expected
        assert {b.name: b.format for b in report.bad}[B.sections()[0].key(BLOCKS_B[0]).hex()] == "canonical_v1"
        assert report.good == 24 - len(expected) and report.formats == FORMATS
        assert {f.name: f.why for f in report.foreign} == FOREIGN
        files = FileBlockStore(root)
        misses: Counter[str] = Counter()
        for g, blocks in ((A, BLOCKS_A), (B, BLOCKS_B)):
            rank = CanonicalRank(files, g, RankPart.of(g))
            rank.fetch_many(blocks)
            misses += rank.misses
        files.close()
        assert misses == Counter(expected.values())
        again = verify_store(admin)
        assert again.bad == [] and again.good == 24 - len(expected)
    finally:
        admin.close()


def test_cli_verify_drop_then_clear_one_model_then_all(
    store: tuple[Path, dict[str, str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify exits 1 naming each bad section, --drop removes them (never a foreign entry); clear selects model
    A's sections by ``canonical:<fingerprint>`` (a dry run until --yes), then clear --yes takes every kvdi object
    and leaves the foreign ones. (In process, as ``kvdi`` runs them; the error line through the real command.)"""
    root, expected = store
    for name in [n for n in os.environ if n.upper().startswith("KVDI_")]:
        monkeypatch.delenv(name)
    for name, value in env(root).items():
        monkeypatch.setenv(name, value)

    def run(*args: str) -> tuple[int, str]:
        code = main(["store", *args])
        return code, capsys.readouterr().out

    code, out = run("verify")
    assert code == 1 and out.count("bad: ") == len(expected)
    assert "(canonical section, checksum)" in out and "(canonical_v1 section, version)" in out
    assert "24 objects checked (canonical 19, canonical_v1 1, per_rank 4), 19 good, 5 bad" in out
    code, out = run("verify", "--drop", "--json")
    assert code == 1 and all(b["dropped"] for b in json.loads(out)["bad"])
    assert run("verify")[0] == 0
    code, out = run("clear", "--layout", f"canonical:{FP_A}")
    assert code == 0 and out.count("would remove: ") == 12 and "(canonical 12)" in out
    code, out = run("clear", "--layout", f"canonical:{FP_A[:8]}", "--yes", "--json")
    assert json.loads(out)["formats"] == {"canonical": 12}
    stats = json.loads(run("stats", "--json")[1])
    assert {n: g["objects"] for n, g in stats["formats"].items()} == {"per_rank": 4, "canonical": 3}
    assert f"canonical:{FP_B}" in stats["layouts"] and f"canonical:{FP_A}" not in stats["layouts"]
    assert "kvdi objects by format: canonical sections: 3, per-rank frames: 4" in run("stats")[1]
    code, out = run("clear", "--yes")
    assert "removed 7 objects (canonical 3, per_rank 4)" in out and "3 foreign entries left alone" in out
    assert {p.name for p in root.glob("??/*")} == set(FOREIGN)
    bad = kvdi("store", "clear", "--layout", "canonical:xyz", env=env(root))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--layout='canonical:xyz'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_keyed_sections_verify_under_their_key_only(tmp_path: Path) -> None:
    """MACed sections: good under their key and without one (the checksum), every one ``mac`` under another key;
    unkeyed sections are ``mac`` under a key (a keyed load refuses them alike)."""
    root = tmp_path / "kv"
    files = FileBlockStore(root)
    secret = FrameKey(b"k" * 32)
    write_sections(files, B, BLOCKS_B, secret)
    write_sections(files, A, BLOCKS_A[:1])
    files.close()
    admin = open_admin(load_settings(shared_storage={"path": root}))
    try:
        mine = verify_store(admin, secret)
        assert mine.good == 4 and Counter(b.reason for b in mine.bad) == Counter(mac=4)
        assert {b.name for b in mine.bad} == {s.key(BLOCKS_A[0]).hex() for s in A.sections()}
        assert verify_store(admin, FrameKey(b"o" * 32)).bad.__len__() == 8
        assert verify_store(admin).good == 8
    finally:
        admin.close()


def test_verify_streams_a_large_section_in_bounded_memory(tmp_path: Path) -> None:
    """A valid 256 MiB section (one KV head of a long block) is checked in 4 MiB pieces, never read whole."""
    big = Geometry("big", 1, 1, 256, 1 << 17, "float32")
    section = big.sections()[0]
    assert big.section_bytes(section) == 256 << 20
    name = section.key(b"\x01" * 16)
    chunk = bytes(4 << 20)
    header = frame_section(big, section, [chunk] * 64, name=name)
    root = tmp_path / "kv"
    FileBlockStore(root).close()
    path = root / name.hex()[:2] / name.hex()
    path.parent.mkdir(parents=True)
    with open(path, "wb") as out:
        out.write(header)
        out.truncate(HEADER_SIZE + (256 << 20))  # sparse zeros: the payload framed above
    admin = open_admin(load_settings(shared_storage={"path": root}))
    tracemalloc.start()
    try:
        report = verify_store(admin)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        admin.close()
    assert report.good == 1 and report.bad == [] and report.formats == {"canonical": 1}
    assert peak < 32 << 20, f"{peak >> 20} MiB to verify one 256 MiB section"


@pytest.mark.redis
def test_redis_stats_verify_drop_and_clear_by_model(redis_server: RedisServer) -> None:
    """The same on a real redis-server: sections written by the Redis store, damaged and planted with SET."""
    redis = pytest.importorskip("redis")
    from kvdi.connectors.redis import RedisBlockStore
    from kvdi.settings import RedisSettings

    client = redis.Redis.from_url(redis_server.url)
    blocks = RedisBlockStore(RedisSettings(url=redis_server.url))
    try:
        expected = plant(
            blocks,
            lambda name: bytes(client.get(b"kvdi:" + name.hex().encode())),
            lambda name, data: client.set(b"kvdi:" + name.hex().encode(), data) and None,
        )
    finally:
        blocks.close()
    admin = open_admin(load_settings(kv_connector="redis", redis={"url": redis_server.url}))
    try:
        stats = store_stats(admin)
        assert {n: g.objects for n, g in stats.formats.items()} == FORMATS and stats.foreign == len(FOREIGN)
        report = verify_store(admin, drop=True)
        assert {b.name: b.reason for b in report.bad} == expected and all(b.dropped for b in report.bad)
        assert {f.name: f.why for f in report.foreign} == FOREIGN
        removed = clear_store(admin, selection=Selection(FP_B[:6]))
        assert removed.formats == {"canonical": 3}
        assert clear_store(admin).formats == {"canonical": 12, "per_rank": 4}
    finally:
        admin.close()
    assert sorted(k.decode() for k in client.keys("kvdi:*")) == sorted(f"kvdi:{n}" for n in FOREIGN)
    client.close()


def test_a_tp1_writers_pack_of_two_sections_is_verified_section_by_section(tmp_path: Path) -> None:
    """A TP=1 writer stores one pack a block (both heads' sections back to back): verify checks each; a bit flipped
    in the second section is ``checksum``, a pack cut short ``length``, as a load counts them."""
    root = tmp_path / "kv"
    files = FileBlockStore(root)
    write_sections(files, B, BLOCKS_B, tp=1)
    files.close()
    first, second = sorted(root.glob("??/*"))  # one pack a block
    admin = open_admin(load_settings(shared_storage={"path": root}))
    try:
        assert verify_store(admin).good == 2
        raw = bytearray(first.read_bytes())
        raw[-1] ^= 1  # the second section's last payload byte
        first.write_bytes(bytes(raw))
        second.write_bytes(second.read_bytes()[:-10])
        report = verify_store(admin)
    finally:
        admin.close()
    assert report.good == 0 and {b.name: b.reason for b in report.bad} == {
        first.name: "checksum",
        second.name: "length",
    }
