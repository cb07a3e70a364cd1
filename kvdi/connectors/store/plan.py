"""What a connector's scheduler half knows about one request: its block keys and what is planned.

Shared by the store halves (:mod:`kvdi.connectors.store`) and the p2p halves: the keys of a
prompt's blocks, how far saves are planned, and the load a lookup offered.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvdi.connectors.base import BlockTransfer


@dataclass
class RequestPlan:
    """Per-request planning state of a scheduler half (one per live request)."""

    keys: list[bytes]
    stored: int = 0  # leading blocks the store held at lookup
    saved: int = 0  # blocks below this are stored or already being saved
    load_from_tokens: int = 0  # computed tokens when the load was offered
    load_start: int = 0
    load_end: int = 0
    load_accepted: bool = False
    load_async: bool = False  # the offered load runs in the background
    held: bool = False  # an asynchronous transfer went to the worker: hold the blocks when it finishes
    looked_up_at: int = -1  # the first block of the last store lookup while the request waits (-1: none to reuse)

    def take_save(self, request_id: str, block_ids: Sequence[int], first: int, done: int) -> BlockTransfer | None:
        """Plan the save of blocks ``[max(saved, first), done)`` (bounded by the known keys and the
        allocated ``block_ids``) and move :attr:`saved` past them; None when nothing is new."""
        start = max(self.saved, first)
        end = min(done, len(block_ids), len(self.keys))
        self.saved = max(self.saved, end)
        if end <= start:
            return None
        return BlockTransfer(request_id, tuple(block_ids[start:end]), tuple(self.keys[start:end]))


class RecentSaves:
    """Keys this scheduler half planned to save lately, at most ``capacity`` (the oldest forgotten first).

    When vLLM's own prefix cache holds every loadable block of a prompt, the full block holding its last token
    (computed anyway) is the only one a save could add; it is planned again only when it is not among these, so
    such a request costs no store round trip (a block evicted from the store since is stored again by the next
    request that computes it without vLLM's cache).
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._keys: dict[bytes, None] = {}

    def add(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._keys.pop(key, None)
            self._keys[key] = None
        while len(self._keys) > self.capacity:
            del self._keys[next(iter(self._keys))]

    def count_from(self, keys: Sequence[bytes], start: int) -> int:
        """The index of the first of ``keys[start:]`` not saved lately (``len(keys)`` when all were)."""
        end = start
        while end < len(keys) and keys[end] in self._keys:
            end += 1
        return end


__all__ = ["RecentSaves", "RequestPlan"]
