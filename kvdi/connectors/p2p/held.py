"""Blocks a p2p producer holds for its consumer: framed host copies by block key.

The producer copies each saved block out of its paged cache into host :class:`Frames`
(one per save, laid out for the wire: layer by layer, so one layer of many blocks is one
contiguous message) and holds them here until the consumer confirms it received them,
until ``hold_s`` passes, or until ``max_bytes`` forces the oldest out. Nothing here talks
to the network; :class:`HeldBlocks` is thread-safe because the producer's worker adds
blocks while its serving thread looks them up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvdi.connectors.store.framing import HEADER_SIZE

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Frames:
    """Framed blocks in wire layout: ``layers[l]`` is layer ``l`` of every block back to back
    (uint8, ``[num_layers, count * layer_bytes]``); ``headers`` their frame headers back to back.

    Block ``i``'s frame is ``headers[i]`` followed by ``layers[0][i], layers[1][i], ...``: the
    same object every kvdi store holds, only laid out for transfer.
    """

    layers: torch.Tensor
    headers: torch.Tensor

    @property
    def count(self) -> int:
        return self.headers.numel() // HEADER_SIZE

    @property
    def nbytes(self) -> int:
        return self.layers.numel() + self.headers.numel()

    def block_range(self, start: int, stop: int) -> Frames:
        """Blocks ``[start, stop)`` as views (no copy)."""
        lb = self.layers.shape[1] // max(self.count, 1)
        return Frames(self.layers[:, start * lb : stop * lb], self.headers[start * HEADER_SIZE : stop * HEADER_SIZE])


@dataclass(eq=False)
class _Group:
    """One save's frames and how many of its keys are still held."""

    frames: Frames
    live: int


@dataclass(eq=False)
class _Entry:
    group: _Group
    index: int
    refs: int
    expires: float


class HeldBlocks:
    """Framed blocks by key with a reference count, an expiry and a byte cap.

    Each :meth:`hold` of a key adds one reference (one consumer may take it once);
    :meth:`release` drops one; :meth:`expire` drops every key past its deadline. Methods
    that free keys return them so the caller can unpublish them.
    """

    def __init__(self, hold_s: float, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of the host buffers still referenced by a held key."""
        return self._bytes

    def hold(self, keys: Sequence[bytes], frames: Frames) -> tuple[list[bytes], list[bytes]]:
        """Hold ``keys[i]`` as block ``i`` of ``frames``; returns ``(keys to publish, keys evicted)``.

        Frames larger than ``max_bytes`` are not held at all (nothing to publish).
        """
        if len(keys) != frames.count:
            raise ValueError(f"{len(keys)} keys for {frames.count} framed blocks")
        if frames.nbytes > self.max_bytes or not keys:
            return [], []
        expires = self._clock() + self.hold_s
        group = _Group(frames, 0)
        new: list[bytes] = []
        with self._lock:
            for index, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is not None:
                    entry.refs += 1
                    entry.expires = max(entry.expires, expires)
                    continue
                self._entries[key] = _Entry(group, index, 1, expires)
                group.live += 1
                new.append(key)
            if group.live:
                self._bytes += frames.nbytes
            evicted = self._evict_locked(protect=group)
        return [k for k in new if k not in evicted], evicted

    def lookup(self, keys: Sequence[bytes]) -> tuple[list[bool], Frames | None]:
        """Which ``keys`` are held, and the frames of the found ones in order.

        When the found blocks are consecutive in one save the result is a view (no copy).
        """
        with self._lock:
            entries = [self._entries.get(k) for k in keys]
        found = [e is not None for e in entries]
        held = [e for e in entries if e is not None]
        if not held:
            return found, None
        first = held[0]
        if all(e.group is first.group and e.index == first.index + i for i, e in enumerate(held)):
            return found, first.group.frames.block_range(first.index, first.index + len(held))
        import torch

        parts = [e.group.frames.block_range(e.index, e.index + 1) for e in held]
        layers = torch.cat([p.layers for p in parts], dim=1)
        return found, Frames(layers, torch.cat([p.headers for p in parts]))

    def release(self, keys: Iterable[bytes]) -> list[bytes]:
        """Drop one reference of each distinct key; returns the keys no longer held."""
        freed: list[bytes] = []
        with self._lock:
            for key in set(keys):
                entry = self._entries.get(key)
                if entry is None:
                    continue
                entry.refs -= 1
                if entry.refs <= 0:
                    self._drop_locked(key)
                    freed.append(key)
        return freed

    def expire(self) -> list[bytes]:
        """Drop every key whose hold time passed; returns them."""
        now = self._clock()
        with self._lock:
            stale = [k for k, e in self._entries.items() if e.expires <= now]
            for key in stale:
                self._drop_locked(key)
        return stale

    def clear(self) -> list[bytes]:
        """Drop everything; returns the keys that were held."""
        with self._lock:
            keys = list(self._entries)
            self._entries.clear()
            self._bytes = 0
        return keys

    def _drop_locked(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        entry.group.live -= 1
        if entry.group.live == 0:
            self._bytes -= entry.group.frames.nbytes

    def _evict_locked(self, protect: _Group) -> list[bytes]:
        """Oldest first, drop keys of other saves until the held bytes fit ``max_bytes``."""
        evicted: list[bytes] = []
        if self._bytes <= self.max_bytes:
            return evicted
        for key in list(self._entries):
            if self._bytes <= self.max_bytes:
                break
            if self._entries[key].group is protect:
                continue
            self._drop_locked(key)
            evicted.append(key)
        return evicted


__all__ = ["Frames", "HeldBlocks"]
