"""``transfer.async_load`` decided in one place: the store scheduler half's LoadPolicy (sync, background or
prefetch, and why), over real in-memory stores; a lookup that takes 2 ms stands in for a store across a network."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from kvdi.connectors.store.load_policy import ASYNC_LOAD_MIN_BYTES, AUTO_PREFETCH_LOOKUP_S, LoadPolicy, auto_way
from kvdi.settings import TransferSettings
from tests.helpers.store import DictStore, small_layout

LAYOUT = small_layout(block_size=4)


class SaysRemote(DictStore):
    prefers_async_load = True


class SlowLookups(DictStore):
    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        self.lookups += 1
        time.sleep(0.002)
        return super().count_prefix(keys)


def policy(setting: str, store: DictStore) -> LoadPolicy:
    return LoadPolicy(TransferSettings(async_load=setting), store, LAYOUT.block_bytes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("setting", "store", "unavailable", "way", "says"),
    [
        ("auto", DictStore, None, "sync", "async_load=auto: a local store (lookup "),
        ("auto", SlowLookups, None, "prefetch", "prefetch at lookup on (async_load=auto; store lookup "),
        ("auto", SaysRemote, None, "prefetch", "prefetch at lookup on (async_load=auto; store lookup "),
        ("auto", SaysRemote, "several KV cache groups", "background", "no prefetch here (several KV cache groups)"),
        ("prefetch", DictStore, None, "prefetch", "prefetch at lookup on (async_load=prefetch; host staging"),
        ("prefetch", SlowLookups, "tensor or pipeline parallelism", "sync", "is not available here (tensor or"),
        ("on", SlowLookups, None, "background", "async_load=on: every hit loads in the background"),
        ("off", SaysRemote, None, "sync", "async_load=off: every hit loads synchronously"),
    ],
)
def test_the_policy_answers_one_way_per_store_and_says_why(
    setting: str, store: type[DictStore], unavailable: str | None, way: str, says: str
) -> None:
    """Each setting, store and host limit gives one way of loading, and describe() names it and the reason."""
    chosen = policy(setting, store())
    chosen.decide_prefetch(unavailable)
    assert chosen.way == way
    assert says in chosen.describe()
    assert chosen.refused is (setting == "prefetch" and way != "prefetch")


def test_auto_measures_the_store_once_and_the_first_answer_stands() -> None:
    """auto times the store's lookup once (fastest of five); asking again neither measures nor changes it."""
    store = SlowLookups()
    chosen = policy("auto", store)
    assert chosen.decide_prefetch() is True and store.lookups == 5
    assert chosen.lookup_s is not None and chosen.lookup_s >= AUTO_PREFETCH_LOOKUP_S
    assert chosen.decide_prefetch("several KV cache groups") is True and store.lookups == 5


def test_without_prefetch_auto_loads_large_hits_and_remote_stores_in_the_background() -> None:
    """The per-hit answer: a local store loads small hits synchronously, from 16 MiB in the background."""
    large = ASYNC_LOAD_MIN_BYTES // LAYOUT.block_bytes
    assert policy("auto", DictStore()).background(4) is False
    assert policy("auto", DictStore()).background(large) is True
    assert policy("auto", SaysRemote()).background(1) is True
    assert policy("prefetch", DictStore()).background(large) is True  # past prefetch's bound: auto's path
    assert auto_way(False, 2e-3, 0, prefetch_here=False) == "sync"  # a slow store where prefetch cannot run
