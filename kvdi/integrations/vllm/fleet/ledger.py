"""Bookkeeping behind kvdi's KV cache events, without vLLM (see :mod:`.events` for the vLLM side).

The facts of an event are spread over processes: the scheduler knows vLLM's block hashes,
tokens and LoRA of a request while it lives; each worker rank knows when its slice of a
block has landed in the store, or when its store evicted or dropped one. The pieces here
join them:

- :class:`WorkerLedger` (each worker rank) maps the rank's slice keys back to block keys
  and drains what landed and what went away;
- :class:`SchedulerLedger` holds each planned block's facts (bounded), counts the ranks
  that reported a block landed, and says when a block is stored on every rank (emit
  ``BlockStored``) or when an announced block went away on any rank (emit ``BlockRemoved``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvdi.connectors.base import BlockTransferMetadata

_T = TypeVar("_T")

MAX_TRACKED = 200_000
"""Blocks whose facts are kept (planned, or announced as stored) before the oldest are forgotten:
a block forgotten after it was announced is not announced as removed (routers age entries out)."""
DRAIN_MAX = 100_000
"""Keys a store may queue as evicted between two steps; beyond that the oldest are not announced."""


@dataclass(frozen=True)
class BlockFacts:
    """What a ``BlockStored`` event carries besides the medium, captured while the request lived."""

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    lora_name: str | None
    lora_id: int | None
    extra_keys: Any = None  # vLLM's per-block extra keys, as vLLM publishes them
    lookahead: tuple[int, ...] | None = None  # tokens after the block its hash covers (vLLM 0.33), None for none


def sink() -> deque[bytes]:
    """A bounded queue of evicted keys: its ``append`` is the watcher a store's ``watch_evictions`` calls."""
    return deque(maxlen=DRAIN_MAX)


def drain(queue: deque[_T] | None) -> list[_T]:
    """Everything queued so far (thread-safe against appenders: popleft until empty)."""
    out: list[_T] = []
    while queue:
        try:
            out.append(queue.popleft())
        except IndexError:
            break
    return out


class WorkerLedger:
    """One worker rank's side: slice key -> block key for the saves it saw (bounded).

    ``rekeys`` are the slice-key functions of *every* rank (``RankSlice.key`` of each), so a
    store shared by the ranks that evicts another rank's slice still names the block.
    """

    def __init__(self, rekeys: Sequence[Callable[[bytes], bytes]] = ()) -> None:
        self._rekeys = list(rekeys)
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()

    def saw(self, metadata: object) -> None:
        """Remember the block key behind each of this step's save keys (before the adapter re-keys them)."""
        if not self._rekeys or not isinstance(metadata, BlockTransferMetadata):
            return
        for transfer in metadata.saves:
            for key in transfer.block_keys:
                for rekey in self._rekeys:
                    self._blocks[rekey(key)] = key
        while len(self._blocks) > MAX_TRACKED:
            self._blocks.popitem(last=False)

    def block_keys(self, keys: Iterable[bytes]) -> Iterator[bytes]:
        """The block key of each slice key this rank knows (all keys when ranks store whole blocks)."""
        for key in keys:
            block = key if not self._rekeys else self._blocks.get(key)
            if block is not None:
                yield block


class SchedulerLedger:
    """The scheduler's side: facts of planned blocks, ranks landed per block, blocks announced."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._facts: OrderedDict[bytes, BlockFacts] = OrderedDict()
        self._landed: Counter[tuple[bytes, str]] = Counter()
        self._announced: OrderedDict[tuple[bytes, str], bytes] = OrderedDict()  # (key, medium) -> vLLM hash

    def planned(self, key: bytes, facts: BlockFacts) -> None:
        self._facts[key] = facts
        self._facts.move_to_end(key)
        while len(self._facts) > MAX_TRACKED:
            self._facts.popitem(last=False)

    def landed(self, key: bytes, medium: str, locality: str | None) -> BlockFacts | None:
        """One rank's slice landed; the block's facts once every rank's has (None until then, or if unknown)."""
        del locality  # one locality per medium: counted by (key, medium)
        slot = (key, medium)
        self._landed[slot] += 1
        while len(self._landed) > MAX_TRACKED:  # slices some rank never landed (its save failed)
            del self._landed[next(iter(self._landed))]
        if self._landed[slot] < self.num_ranks:
            return None
        del self._landed[slot]
        facts = self._facts.get(key)
        if facts is not None:
            self._announced[(key, medium)] = facts.block_hash
            while len(self._announced) > MAX_TRACKED:
                self._announced.popitem(last=False)
        return facts

    def announce(self, key: bytes, medium: str, block_hash: bytes) -> None:
        """A block announced without a save of this engine's (a load's report for a shared tier): its removal is
        announced like a stored block's."""
        self._announced[(key, medium)] = block_hash
        while len(self._announced) > MAX_TRACKED:
            self._announced.popitem(last=False)

    def removed(self, key: bytes, medium: str) -> bytes | None:
        """vLLM's hash of an announced block that went away on some rank (once), else None."""
        self._landed.pop((key, medium), None)  # a slice gone before every rank reported: never announced
        return self._announced.pop((key, medium), None)

    def clear(self) -> None:
        self._facts.clear()
        self._landed.clear()
        self._announced.clear()


__all__ = [
    "DRAIN_MAX",
    "MAX_TRACKED",
    "BlockFacts",
    "SchedulerLedger",
    "WorkerLedger",
    "drain",
    "sink",
]
