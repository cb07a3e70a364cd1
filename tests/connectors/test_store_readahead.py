"""Read-ahead: the worker half keeps a store's prefetch() ahead of its reads while the medium is cold."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store import StoreCapabilities
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.keys import block_keys
from kvdi.connectors.store.reads import Readahead
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
FRAME = HEADER_SIZE + LAYOUT.block_bytes
PROMPT = request(range(18))
KEYS = block_keys(PROMPT.prompt_token_ids, LAYOUT)


class PrefetchingStore(DictStore):
    """A test double: a dict store that records the prefetch hints it gets and answers ``cold``."""

    def __init__(self, cold: bool) -> None:
        super().__init__()
        self.cold = cold
        self.hints: list[list[bytes]] = []

    def prefetch(self, keys: Sequence[bytes]) -> bool:
        self.hints.append(list(keys))
        return self.cold


def test_prefetch_is_a_declared_capability() -> None:
    assert StoreCapabilities.of(PrefetchingStore(True)).prefetch is not None
    assert StoreCapabilities.of(DictStore()).prefetch is None


@pytest.mark.parametrize("cold", [True, False])
def test_a_load_asks_for_its_blocks_ahead_and_loads_them(cold: bool) -> None:
    store = PrefetchingStore(cold)
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
    assert Engine(store, LAYOUT, make_settings()).prefill(PROMPT, (6, 7, 8, 9, 10)) == (16, set())
    assert store.hints == [KEYS[:4]]


def test_readahead_slides_in_quarter_windows_while_cold_and_stops_once_warm() -> None:
    keys = [bytes([i]) * 16 for i in range(40)]
    asked: list[tuple[int, int]] = []
    answers = iter([True, True, False])

    def prefetch(batch: Sequence[bytes]) -> bool:
        asked.append((keys.index(batch[0]), keys.index(batch[-1]) + 1))
        return next(answers)

    ahead = Readahead(prefetch, keys, window=8)
    for start in range(0, 40):
        ahead.before(start)
    assert asked == [(0, 8), (8, 10), (10, 12)]  # the third answer says warm: no more hints


def test_a_failing_prefetch_is_only_a_hint() -> None:
    def prefetch(_keys: Sequence[bytes]) -> bool:
        raise OSError("medium gone")

    ahead = Readahead(prefetch, [b"k" * 16] * 4, window=2)
    ahead.before(0)
    ahead.before(2)  # no exception, and no further calls after the failure


def _drop_pages(path: Path) -> bool:
    """Evict ``path`` from the page cache; False when this file system keeps it (e.g. tmpfs).

    The probe (a read with ``RWF_NOWAIT``) starts reading the page back in when it fails, so
    the file is evicted once more after it.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(3):  # a page still in a per-CPU LRU batch survives one call
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            try:
                os.preadv(fd, [memoryview(bytearray(1))], FRAME - 1, os.RWF_NOWAIT)
            except BlockingIOError:
                time.sleep(0.05)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                return True
        return False
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv(RWF_NOWAIT) (Linux)")
def test_shared_storage_prefetch_says_warm_for_cached_objects_and_cold_for_evicted_ones(tmp_path: Path) -> None:
    store = FileBlockStore(tmp_path / "kv", object_bytes=FRAME)
    try:
        Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, (1, 2, 3, 4, 5))
        assert store.prefetch(KEYS) is False
        assert store.prefetch([]) is False and store.prefetch([b"\x00" * 16]) is True  # absent: no probe, no error
        if not all(_drop_pages(store.path_for(k)) for k in KEYS):
            pytest.skip("this file system keeps files in memory (no cold reads to test)")
        assert store.prefetch(KEYS) is True
        assert Engine(store, LAYOUT, make_settings()).prefill(PROMPT, (6, 7, 8, 9, 10)) == (16, set())
    finally:
        store.close()
