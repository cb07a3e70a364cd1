"""What a connector's scheduler half knows about one request: its block keys and what is planned.

Shared by the store halves (:mod:`kvdi.connectors.store`) and the p2p halves: the keys of a
prompt's blocks, how far saves are planned, and the load a lookup offered.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    def take_save(self, request_id: str, block_ids: Sequence[int], first: int, done: int) -> BlockTransfer | None:
        """Plan the save of blocks ``[max(saved, first), done)`` (bounded by the known keys and the
        allocated ``block_ids``) and move :attr:`saved` past them; None when nothing is new."""
        start = max(self.saved, first)
        end = min(done, len(block_ids), len(self.keys))
        self.saved = max(self.saved, end)
        if end <= start:
            return None
        return BlockTransfer(request_id, tuple(block_ids[start:end]), tuple(self.keys[start:end]))


__all__ = ["RequestPlan"]
