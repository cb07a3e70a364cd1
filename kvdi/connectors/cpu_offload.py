"""The ``cpu_offload`` backend: a host memory pool of fixed-size slots with LRU eviction.

The pool is one buffer of ``max_bytes // frame_bytes`` slots, allocated on first write. Each slot holds one
framed object (its header, then the block's payload as one run), verified on load like an object of any
other store. Next to a CUDA cache (``allocator.pin_memory`` on) the buffer is page-locked, exactly its
size (:class:`~kvdi.connectors.pinned.HostRegion`, not torch's power-of-two caching allocator) and
released on close; on a CPU it is pageable memory, each slot padded to whole cache lines so that every
payload starts on one (copies between a payload and the cache run at memcpy's full speed). The container builds one
pool per engine and hands it to both halves; a lock makes it safe to share across threads.

Eviction drops the least recently used object. Within one batch (a chain of one request,
saved or loaded together) the head is marked most recently used, so chains go tail first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvdi.connectors.logging_once import log_once
from kvdi.connectors.pinned import HostRegion, HostRegistrar, cuda_registrar
from kvdi.connectors.store.bytecopy import gather, scatter
from kvdi.connectors.store.framing import HEADER_SIZE, Buffer
from kvdi.connectors.store.integrity import frame_key
from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from kvdi.layout import KVCacheSpec
    from kvdi.settings import CpuOffloadSettings, KvdiSettings

logger = logging.getLogger(__name__)

_BACKEND_ERRORS = (ValueError, TypeError, OverflowError, MemoryError, RuntimeError, OSError)
LINE = 64  # bytes of a CPU cache line
FRAME_OFFSET = -HEADER_SIZE % LINE  # where a frame starts in a pageable slot: its payload then starts on a line
SAVE_BATCH_BYTES = 4 << 20  # frame bytes a save from a CPU cache hands to one put_many (see save_batch_blocks)


class HostPoolStore:
    """A :class:`~kvdi.connectors.store.BlockStore` in host memory: ``num_slots`` slots of ``slot_bytes``."""

    hit_source = "host"  # the tier vLLM's external_prefix_cache_hits names (vllm CacheHitSource)

    def __init__(
        self, num_slots: int, slot_bytes: int, pin_memory: bool = False, registrar: HostRegistrar | None = None
    ) -> None:
        """``pin_memory``: page-lock the pool with ``registrar`` (None: CUDA's, :func:`cuda_registrar`)."""
        if num_slots < 1:
            raise ValueError("a host pool needs at least one slot")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        # Saves from a CPU cache come in batches of about SAVE_BATCH_BYTES (:mod:`~kvdi.connectors.store.writes`):
        # one call per 1 MiB block cost ~4 us of lock, LRU and call chain (~3 % of its copy); the pieces are views
        # of the cache (no staging), and the lock is held ~0.5 ms per batch, not more.
        self.save_batch_blocks = max(1, SAVE_BATCH_BYTES // slot_bytes)
        self._pin = pin_memory
        self._registrar = registrar
        self._pool: np.ndarray | None = None
        self._frames: memoryview | None = None  # the slots as one byte view: slot i's frame starts at i * _stride
        self._stride = slot_bytes
        self._region: HostRegion | None = None  # the pool's memory, once allocated
        self._reserved: dict[int, np.ndarray] = {}  # slots lent to a device copy (:meth:`reserve`): their payload
        self._lru: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (slot, size)
        self._free: list[int] = []  # slots given back by discard
        self._unused = 0  # slots from here on were never used (no list of num_slots entries)
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._evicted: Callable[[bytes], None] | None = None  # the eviction watcher (KV cache events)

    def watch_evictions(self, evicted: Callable[[bytes], None]) -> None:
        """:class:`~kvdi.connectors.store.EvictingStore`: ``evicted(key)`` for each block the LRU drops."""
        self._evicted = evicted

    def _slots(self) -> np.ndarray:
        """The pool as ``num_slots`` rows of ``slot_bytes``, row ``i`` being slot ``i``'s frame (allocated now)."""
        if self._pool is None:
            self._pool = self._pinned() if self._pin else None
            if self._pool is None:
                self._pool = self._pageable()
        return self._pool

    def _pageable(self) -> np.ndarray:
        """Pageable slots laid out so that every payload starts on a cache line: the frame begins
        :data:`FRAME_OFFSET` bytes into a slot of a whole number of lines. A payload 24 bytes off a line
        (a frame right at the start of a slot) makes every copy between it and the cache about 20 % slower."""
        stride = -(-(FRAME_OFFSET + self.slot_bytes) // LINE) * LINE
        # Page-aligned, unmapped on close; huge pages as numpy gave its large arrays (the pool was one before):
        # without them a copy between a payload and the cache measured ~10 % slower.
        self._region = HostRegion(self.num_slots * stride, huge_pages=True)
        assert self._region.array is not None
        frames = self._region.array[FRAME_OFFSET:]
        self._frames, self._stride = frames.data, stride
        return np.lib.stride_tricks.as_strided(frames, (self.num_slots, self.slot_bytes), (stride, 1))

    def _pinned(self) -> np.ndarray | None:
        """The pool page-locked, exactly its bytes; None (pageable, logged) when the driver refuses."""
        nbytes = self.num_slots * self.slot_bytes
        try:
            registrar = self._registrar if self._registrar is not None else cuda_registrar()
            self._region = HostRegion(nbytes, registrar)
        except (RuntimeError, OSError, MemoryError) as exc:
            logger.warning("cpu_offload: page-locking the %d B pool failed, using pageable memory: %s", nbytes, exc)
            return None
        array = self._region.array
        if array is None:
            return None
        self._frames, self._stride = array.data, self.slot_bytes
        return array.reshape(self.num_slots, self.slot_bytes)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the pool page-locked for the device now (0: pageable, or not allocated yet)."""
        return self._region.nbytes if self._region is not None and self._region.pinned else 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def stored_bytes(self) -> int:
        """Bytes of the slots in use (for ``vllm:kvdi_store_bytes``)."""
        return len(self._lru) * self.slot_bytes

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            for n, key in enumerate(keys):
                if key not in self._lru:
                    return n
            return len(keys)

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Copies of the objects (a slot may be reused as soon as the lock is released)."""
        with self._lock:
            pool = self._pool
            out: list[Buffer | None] = []
            for key in keys:
                entry = self._lru.get(key)
                out.append(None if entry is None or pool is None else pool[entry[0], : entry[1]].tobytes())
            self._touch(keys)
            return out

    def get_into_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        """Copy each object straight from its slot into its pieces when sizes match (see ``ReadIntoStore``)."""
        with self._lock:
            frames, stride = self._frames, self._stride
            out: list[int | None] = []
            for key, pieces in items:
                entry = self._lru.get(key)
                if entry is None or frames is None:
                    out.append(None)
                    continue
                slot, size = entry
                if size == sum(p.nbytes for p in pieces):
                    scatter(frames[slot * stride : slot * stride + size], pieces)
                out.append(size)  # at most one slot: an object never outgrows the frame it was stored as
            self._touch([k for k, _ in items])
            return out

    def visit_many(self, keys: Sequence[bytes], visit: Callable[[int, memoryview], None]) -> list[bool]:
        """Lend each object's slot to ``visit`` under the lock (see ``ViewStore``): the worker half verifies the
        frame there and copies its payload out while it is in the CPU cache, one pass over memory."""
        with self._lock:
            frames, stride = self._frames, self._stride
            present: list[bool] = []
            for i, key in enumerate(keys):
                entry = self._lru.get(key)
                if entry is None or frames is None:
                    present.append(False)
                    continue
                start = entry[0] * stride
                visit(i, frames[start : start + entry[1]])  # at most one slot: never more than a frame
                present.append(True)
            self._touch(keys)
            return present

    def reserve(self, n: int, nbytes: int) -> list[np.ndarray] | None:
        """For a device cache's save (:class:`~kvdi.connectors.store.blockio.CacheIO`): ``n`` slots taken out
        of use (evicting as a write would) and their payload regions of ``nbytes``, after a frame header, for a
        device copy to fill. Each is then stored by :meth:`put_many` with that region as its payload (the slot
        is adopted: no copy) or handed back by :meth:`release`. None unless the pool is page-locked."""
        with self._lock:
            free = self.num_slots - len(self._reserved)
            if not self.pinned_bytes or self._pool is None or HEADER_SIZE + nbytes > self.slot_bytes or n > free:
                return None
            payloads = []
            for _ in range(n):
                slot = self._take_slot()
                self._reserved[slot] = self._pool[slot, HEADER_SIZE : HEADER_SIZE + nbytes]
                payloads.append(self._reserved[slot])
            return payloads

    def release(self, payloads: Sequence[np.ndarray]) -> None:
        """Hand back reserved payload regions that were not stored (stored ones are the pool's again already;
        a region handed out again since, to another caller, is that caller's: matched by identity)."""
        with self._lock:
            for payload in payloads:
                slot = self._slot_of(payload.data)
                if slot is not None and self._reserved.get(slot) is payload:
                    del self._reserved[slot]
                    self._free.append(slot)

    def _slot_of(self, payload: memoryview) -> int | None:
        """The slot whose payload region starts where ``payload`` does, if any."""
        if self._pool is None or not payload.nbytes:
            return None
        offset = np.frombuffer(payload, dtype=np.uint8).ctypes.data - self._pool.ctypes.data
        slot, at = divmod(offset, self._pool.strides[0])
        return slot if at == HEADER_SIZE and 0 <= slot < self.num_slots else None

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> int:
        """Copy each object into a slot, evicting LRU objects; returns how many were stored.

        Objects larger than a slot are not kept; a failure (the pool cannot be allocated, a
        piece is no byte buffer) skips that object and is logged once, never raised. An object of
        a header and a payload that is a reserved slot's region (:meth:`reserve`) adopts that slot.
        """
        stored = 0
        with self._lock:
            for key, pieces in items:
                try:
                    stored += self._put(key, pieces)
                except _BACKEND_ERRORS as exc:
                    log_once(
                        logger,
                        self._logged,
                        type(exc).__name__,
                        "cpu_offload: storing an object failed: %r (at most once a minute)",
                        exc,
                    )
            self._touch([k for k, _ in items])
        return stored

    def _put(self, key: bytes, pieces: Sequence[Buffer]) -> int:
        views = [p if isinstance(p, memoryview) and p.format == "B" else memoryview(p).cast("B") for p in pieces]
        size = sum(map(len, views))  # 1-D byte views: len is nbytes
        if size > self.slot_bytes:
            return 0
        if self._reserved and len(views) == 2 and len(views[0]) == HEADER_SIZE:
            slot = self._slot_of(views[1])
            if slot in self._reserved:  # a reserved slot the device filled: write its header, keep it
                return self._adopt(key, slot, views[0], size)
        self._slots()
        assert self._frames is not None
        entry = self._lru.pop(key, None)
        slot = entry[0] if entry is not None else self._take_slot()
        start = slot * self._stride
        gather(views, self._frames[start : start + size])
        self._lru[key] = (slot, size)
        return 1

    def _adopt(self, key: bytes, slot: int, header: memoryview, size: int) -> int:
        assert self._pool is not None
        del self._reserved[slot]
        old = self._lru.pop(key, None)
        if old is not None:
            self._free.append(old[0])
        self._pool[slot, :HEADER_SIZE].data.cast("B")[:] = header
        self._lru[key] = (slot, size)
        return 1

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        if self._unused < self.num_slots:
            self._unused += 1
            return self._unused - 1
        key, (slot, _size) = self._lru.popitem(last=False)
        if self._evicted is not None:
            self._evicted(key)
        return slot

    def _touch(self, keys: Sequence[bytes]) -> None:
        # Tail of the batch first, head last: the head ends most recently used.
        for key in reversed(keys):
            if key in self._lru:
                self._lru.move_to_end(key)

    def discard(self, key: bytes) -> None:
        with self._lock:
            entry = self._lru.pop(key, None)
            if entry is not None:
                self._free.append(entry[0])

    def check(self) -> str:
        """``kvdi check``'s one-line summary (``CheckedStore``); the pool itself is allocated on the first write."""
        gib = self.num_slots * self.slot_bytes / 2**30
        kind = "page-locked for CUDA, exactly its size" if self._pin else "pageable"
        shape = f"{self.num_slots} slots of {self.slot_bytes} B ({gib:.2f} GiB, {kind})"
        return f"cpu_offload: {shape}, allocated on first write"

    def close(self) -> None:
        """Drop the pool."""
        with self._lock:
            self._lru.clear()
            self._free, self._unused = [], 0
            self._reserved.clear()
            self._pool = self._frames = None
            region, self._region = self._region, None
            if region is not None:
                region.close()  # unregistered and unmapped now, not at exit


def open_store(options: CpuOffloadSettings, layout: KVCacheSpec, settings: KvdiSettings) -> HostPoolStore:
    """The backend factory named by the ``cpu_offload`` spec: ``max_bytes // frame`` slots."""
    frame_bytes = HEADER_SIZE + layout.block_bytes
    num_slots = options.max_bytes // frame_bytes
    if num_slots < 1:
        raise ConfigError(
            f"KVDI_CPU_OFFLOAD__MAX_BYTES={options.max_bytes} holds no block: one framed block of this "
            f"layout is {frame_bytes} B; raise it to at least {frame_bytes}"
        )
    frame_key(settings)  # a bad integrity key is a ConfigError when the backend is built (and in `kvdi check`)
    return HostPoolStore(num_slots, frame_bytes, pin_memory=pins_for_device(settings))


def pins_for_device(settings: KvdiSettings) -> bool:
    """Whether the pool is page-locked: next to a CUDA cache with ``allocator.pin_memory`` on (never on a CPU)."""
    if not settings.allocator.pin_memory or settings.allocator.device == "cpu":
        return False
    import torch

    return bool(torch.cuda.is_available())


__all__ = ["HostPoolStore", "open_store", "pins_for_device"]
