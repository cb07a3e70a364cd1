"""What made the ``50`` row of ``bench_remote.py --rows`` exceed 1.1x with the load deadline on (issue 34), replayed
deterministically: a step's four arrivals prefetch their hits at once, not two at a time (the third and fourth waited
a whole round trip behind the first two, past the deadline that expects one, and were abandoned, then recomputed)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvdi.connectors.store.prefetch import PREFETCH_THREADS, HostStaging
from tests.helpers.store import DictStore

ARRIVALS = 4  # the row's requests, arriving together


class RendezvousStore(DictStore):
    """A store across a network: each ``get_many`` answers only once ``ARRIVALS`` of them are in flight together (a
    round trip they all wait out at once); fewer in flight at once break the rendezvous (the call raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.rendezvous = threading.Barrier(ARRIVALS, timeout=2.0)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        self.rendezvous.wait()
        return super().get_many(keys)


def test_a_step_s_arrivals_prefetch_at_once() -> None:
    store = RendezvousStore()
    for r in range(ARRIVALS):
        store.put_many([(f"k{r}".encode(), [b"x" * 16])])
    staging = HostStaging(store, 1 << 20, 64, "t")
    assert PREFETCH_THREADS >= ARRIVALS
    try:
        for r in range(ARRIVALS):
            staging.start(f"r{r}", [f"k{r}".encode()])
        reports: list[tuple[str, int]] = []
        while len(reports) < ARRIVALS and staging.wait(5.0):
            got, failed = staging.reports()
            assert failed == 0, "a prefetch waited for another to finish: the rendezvous broke"
            reports += got
        assert sorted(reports) == [(f"r{r}", 1) for r in range(ARRIVALS)]
    finally:
        staging.shutdown()
