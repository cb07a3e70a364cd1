"""Prefetch at lookup reads a step's hits in batches: the worker's host staging splits the step's prefetches over
its threads and reads each share in one store call (one round trip for many requests), then reports each request
as before (its leading staged objects; a gap, a junk entry or a failure ends only its own hit)."""

from __future__ import annotations

from collections.abc import Sequence

from kvdi.connectors.base import BlockTransfer
from kvdi.connectors.store.prefetch import HostStaging
from tests.helpers.store import DictStore

FRAME = 64


class Counting(DictStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        self.junk: bytes | None = None

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        self.calls.append(len(keys))
        got = super().get_many(keys)
        return [0 if k == self.junk else o for k, o in zip(keys, got, strict=True)]  # type: ignore[misc]


def keys(rid: int, n: int = 3) -> tuple[bytes, ...]:
    return tuple(bytes([rid, i]) * 16 for i in range(n))


def drained(staging: HostStaging, expect: int) -> dict[str, int]:
    reports: dict[str, int] = {}
    while len(reports) < expect:
        assert staging.wait(10)
        reports.update(staging.reports()[0])
    return reports


def test_a_steps_prefetches_are_read_in_one_call_per_thread() -> None:
    store = Counting()
    for rid in range(8):
        store.put_many([(k, [b"x" * FRAME]) for k in keys(rid)[: rid % 4]])  # request r holds r % 4 (max 3) blocks
    staging = HostStaging(store, 1 << 20, FRAME, "t", threads=2)
    staging.apply([BlockTransfer(f"r{rid}", (0, 1, 2), keys(rid)) for rid in range(8)], ())
    reports = drained(staging, 8)
    assert reports == {f"r{rid}": min(rid % 4, 3) for rid in range(8)}
    assert store.calls == [12, 12]  # 8 requests x 3 keys, over 2 threads
    staging.shutdown()


def test_a_junk_entry_ends_only_its_requests_hit_and_counts_from_there() -> None:
    store = Counting()
    for rid in range(2):
        store.put_many([(k, [b"x" * FRAME]) for k in keys(rid)])
    store.junk = keys(1)[1]
    staging = HostStaging(store, 1 << 20, FRAME, "t", threads=1)
    staging.apply([BlockTransfer(f"r{rid}", (0, 1, 2), keys(rid)) for rid in range(2)], ())
    assert drained(staging, 2) == {"r0": 3, "r1": 1}
    assert staging.failed == 1 and len(store.calls) == 1
    staging.shutdown()
