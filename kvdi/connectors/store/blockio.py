"""Byte views of the paged KV cache for the store halves: where a block's frame is read from and written to.

A block of one layer (``cache[block_id]``, K then V) is contiguous, so one stored payload is
``num_layers`` contiguous pieces. On a CPU cache the pieces are views of the cache itself:
saves write straight from it and loads read straight into it (no staging copy). On a device
cache, blocks bounce through a host staging buffer taken from the engine's allocator
(:meth:`kvdi.allocator.GpuBufferAllocator.staging`: pinned when the cache is on CUDA and
``KVDI_ALLOCATOR__PIN_MEMORY`` is on); its copies are ordered against the engine's CUDA stream
by :mod:`kvdi.connectors.streams` (events, a fenced side stream for background jobs, no
device-wide synchronize). Next to a page-locked pool (cpu_offload on CUDA) loads skip the staging: each
block goes straight from the slot the pool lends to the device (:meth:`CacheIO.load_straight`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from kvdi.connectors.store.bytecopy import gather as gather  # re-exported: cpu_offload, multi, redis use them
from kvdi.connectors.store.bytecopy import scatter as scatter
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.connectors.store.staged_order import ReorderedCopies, staged_order
from kvdi.connectors.streams import StreamOrder, order_for

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kvdi.allocator import Staging
    from kvdi.layout import KVCacheSpec


@runtime_checkable
class SlotSink(Protocol):
    """A store whose slots a device save fills straight (cpu_offload's page-locked pool: ``HostPoolStore``)."""

    def reserve(self, n: int, nbytes: int) -> list[np.ndarray] | None: ...

    def release(self, payloads: Sequence[np.ndarray]) -> None: ...


SLOTS = 2
"""Staging chunks of a device cache's :class:`CacheIO`, used in turn: one chunk's store I/O overlaps the
previous chunk's copies."""


class SaveTicket(NamedTuple):
    """A chunk whose copy-out was queued by :meth:`CacheIO.start_save` (its bytes: :meth:`CacheIO.saved`)."""

    slot: int
    block_ids: tuple[int, ...]


class CacheIO(ReorderedCopies):
    """Per-layer uint8 views of the caches, plus staging for device caches.

    A device cache (``direct`` False) moves a chunk of up to ``chunk`` blocks with a fixed number of calls,
    whatever the number of blocks: the block ids are uploaded once, each layer is gathered
    (``index_select(out=)``) into or scattered (``index_copy_``) out of a device scratch whose row ``i`` is
    block ``i`` of the chunk, layer after layer, and the scratch moves to or from a pinned host chunk in one
    ``copy_``. A staged block is one contiguous run (one piece); the host chunks form a ring of :data:`SLOTS`,
    each with the event after its copies, so the store I/O of one chunk overlaps the copies of the previous one.
    With ``reorder`` set (:mod:`.staged_order`) a chunk is permuted into a canonical store's order on the device.
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        layer_bytes: int,
        chunk: int,
        staging: bool | None = None,
        buffers: Staging | None = None,
        order: StreamOrder | None = None,
        owner: str | None = None,
        device_chunk: int | None = None,
    ) -> None:
        """``staging`` forces (True) or forbids (False) the host bounce; None: only for non-CPU caches.

        ``chunk`` is the most blocks one chunk moves (``device_chunk`` instead when staged, if given).
        ``buffers`` is where the staging comes from (the worker half's ``context.staging``); None: a private
        :class:`~kvdi.allocator.StagingBuffers`. ``owner`` names the staging buffers there (asking again
        under the same owner replaces them). ``order`` orders the copies of a CUDA cache against the
        engine's stream (:mod:`kvdi.connectors.streams`); None: :func:`~kvdi.connectors.streams.order_for`
        the cache's device.
        """
        import torch

        if not caches:
            raise ValueError("register_kv_caches() got no cache tensors")
        first = caches[0]
        self.num_blocks = int(first.shape[0])
        self.layer_bytes = layer_bytes
        self._u8: list[torch.Tensor] = []
        for t in caches:
            if not t.is_contiguous() or t.device != first.device or int(t.shape[0]) != self.num_blocks:
                raise ValueError("cache tensors must be contiguous, on one device, with the same number of blocks")
            if t[0].numel() * t.element_size() != layer_bytes:
                raise ValueError(
                    f"a cache block of shape {tuple(t.shape[1:])} ({t.dtype}) is not {layer_bytes} B: "
                    "the cache does not match the connector's KV layout"
                )
            self._u8.append(t.view(torch.uint8).view(self.num_blocks, layer_bytes))
        self.direct = first.device.type == "cpu" if staging is None else not staging
        self.order = order if order is not None else order_for(first.device)
        self.chunk = chunk if self.direct or device_chunk is None else min(device_chunk, self.num_blocks)
        chunk = self.chunk  # staged: never more blocks than the cache holds
        # Flat byte views of each layer: a block's piece is a slice (cheaper than indexing an array per call).
        self._flat = [u.numpy().reshape(-1).data.cast("B") for u in self._u8] if self.direct else []
        self._row_bytes = layer_bytes * len(caches)
        self._slot = 0
        self._events: list[Any] = [None] * SLOTS  # per slot: the event after its queued copies (None: none queued)
        self._last: Any = None  # the event after the last copies queued
        self._committed: list[int] = []  # block ids loaded into rows 0, 1, ... of this slot, not yet copied in
        self._straight: set[int] = set()  # rows of this chunk copied straight into the device scratch
        self.sink: SlotSink | None = None  # a page-locked pool a save copies into straight (set by CacheIOs)
        self._held: list[list[np.ndarray] | None] = [None] * SLOTS  # per ring slot: the sink's slots it filled
        self._lent: Any = None  # the event after the last straight copy out of a store's lent frame
        if self.direct:
            return
        if buffers is None:
            from kvdi.allocator import StagingBuffers

            buffers = StagingBuffers(pin_memory=first.device.type == "cuda")
        name = owner or f"cacheio-{id(self)}"
        host = buffers(SLOTS * chunk * self._row_bytes, owner=name).view(SLOTS, chunk, self._row_bytes)
        self._rows = list(host.unbind(0))
        self._rows_np = [r.numpy() for r in self._rows]
        index = buffers(SLOTS * chunk * 8, owner=f"{name}/index").view(torch.int64).view(SLOTS, chunk)
        self._index = list(index.unbind(0))  # pinned with the staging: uploaded asynchronously, once per chunk
        self._index_np = [i.numpy() for i in self._index]
        # The device scratch and ids are taken at the first copy, not here (:meth:`_device`): registration
        # comes after vLLM sized its cache, and a cache only ever read from the host side needs none.
        self._buffers, self._name, self._device_at = buffers, name, first.device
        self._scratch: torch.Tensor | None = None
        # The gathers and scatters move 8-byte words where the layout allows (a byte-wise index kernel is slower).
        self._word = torch.int64 if layer_bytes % 8 == 0 else torch.uint8
        self._words = [u.view(self._word) for u in self._u8]
        self._layer_words = self._words[0].shape[1]

    def _device(self) -> torch.Tensor:
        """The device scratch (one chunk of rows, at most ``device_chunk`` blocks), with its ids taken at first use."""
        if self._scratch is not None:
            return self._scratch
        import torch

        chunk, where = self.chunk, self._device_at
        scratch = self._buffers(chunk * self._row_bytes, device=where, owner=f"{self._name}/scratch")
        self._index_dev = self._buffers(chunk * 8, device=where, owner=f"{self._name}/index-dev").view(torch.int64)
        self._scratch = scratch.view(chunk, self._row_bytes)
        self._scratch_words = self._scratch.view(self._word)
        return self._scratch

    @property
    def device_scratch_bytes(self) -> int:
        """Device bytes this CacheIO holds outside the cache: 0 until its first staged copy."""
        return (0 if self._scratch is None else self.chunk * (self._row_bytes + 8)) + self.reordered_bytes

    # -- the ring -------------------------------------------------------------------------------

    def begin(self) -> None:
        """Start a chunk in the next staging slot; waits only if that slot's copies are still in flight."""
        if self.direct:
            return
        if self._committed:
            self._copy_in()
        self._straight = set()  # rows copied straight but never committed (a bad block) are not this chunk's
        self._slot = (self._slot + 1) % SLOTS
        self._wait_slot(self._slot)
        self._release(self._slot)

    def _release(self, slot: int) -> None:
        """Hand the sink back its slots a save of ring slot ``slot`` filled and did not store."""
        held, self._held[slot] = self._held[slot], None
        if held and self.sink is not None:
            self.sink.release(held)

    def _wait_slot(self, slot: int) -> None:
        event = self._events[slot]
        if event is not None:
            event.synchronize()
            self._events[slot] = None
            if event is self._last:
                self._last = None

    def finish(self) -> None:
        """Queue the copies of committed loads, then wait for every copy this CacheIO queued (before staging
        is read or reused): on the event after them on the current stream, never a device-wide synchronize."""
        if self._committed:
            self._copy_in()
        self._straight = set()
        for slot in range(SLOTS):
            self._release(slot)
        if self.order is None:
            return
        if self._last is not None:
            self._last.synchronize()
        self._events = [None] * SLOTS
        self._last = None

    def _mark(self, slot: int) -> None:
        if self.order is not None:
            self._events[slot] = self._last = self.order.mark()

    # -- loads ----------------------------------------------------------------------------------

    def load_pieces(self, i: int, block_id: int) -> list[memoryview]:
        """Where the ``i``-th block of a chunk is read into: the cache block itself (one piece per layer),
        or row ``i`` of this chunk's staging (one piece)."""
        if self.direct:
            start = block_id * self.layer_bytes
            return [m[start : start + self.layer_bytes] for m in self._flat]
        return [memoryview(self._rows_np[self._slot][i])]

    @staticmethod
    def copy_payload(payload: memoryview, pieces: Sequence[memoryview]) -> None:
        """Copy a verified contiguous payload into ``pieces`` in order."""
        scatter(payload, pieces)

    def commit_load(self, i: int, block_id: int) -> None:
        """Make a loaded block visible in the cache. Device caches: rows are committed in order (0, 1, ...)
        and copied in together, by :meth:`submit`, :meth:`begin` or :meth:`finish`."""
        if self.direct:
            return
        if i != len(self._committed):
            raise ValueError(f"staging row {i} committed out of order (next is {len(self._committed)})")
        self._committed.append(block_id)

    def submit(self) -> None:
        """Queue the copies of the loads committed in this chunk (asynchronous; :meth:`finish` waits)."""
        if self._committed:
            self._copy_in()

    def load_straight(self, i: int, frame: memoryview) -> bool:
        """Queue the copy of block ``i`` of this chunk straight from a frame a store lends (``visit_many``) into
        the device scratch, when the frame lies in page-locked memory (cpu_offload's pool next to a CUDA cache):
        one run, no host copy. False (nothing queued): place it through staging. The caller verifies the frame
        meanwhile, then calls :meth:`release_lent` before the store may reuse the frame's memory."""
        if self.direct or self.order is None:
            return False
        src = self._pinned_payload(frame)
        if src is None:
            return False
        self._copy(self._landing(self._device())[i], src)
        self._straight.add(i)
        self._lent = self.order.mark()
        return True

    def _pinned_payload(self, frame: memoryview) -> torch.Tensor | None:
        """The payload of ``frame`` as a tensor when it is one staged row in page-locked memory, else None."""
        import torch

        if frame.nbytes != HEADER_SIZE + self._row_bytes or frame.readonly:
            return None
        payload = torch.frombuffer(frame, dtype=torch.uint8)[HEADER_SIZE:]
        return payload if payload.is_pinned() else None

    def release_lent(self) -> None:
        """Wait (on its event) until the straight copy out of the last lent frame is done."""
        event, self._lent = self._lent, None
        if event is not None:
            event.synchronize()

    def _copy_in(self) -> None:
        rows = self._device()
        ids, self._committed = self._committed, []
        straight, self._straight = self._straight, set()
        n, lw, landed = len(ids), self._layer_words, self._landing(rows)
        index = self._upload(ids)
        if not straight:
            self._copy(landed[:n], self._rows[self._slot][:n])
        for r in range(n):  # a chunk mixing both (never from one store): the staged rows one by one
            if straight and r not in straight:
                self._copy(landed[r], self._rows[self._slot][r])
        self._to_cache_order(landed, rows, n)
        scratch = self._scratch_words[:n]
        for l, u in enumerate(self._words):  # noqa: E741
            self._scatter(u, index, scratch[:, l * lw : (l + 1) * lw])
        self._mark(self._slot)

    # -- saves ----------------------------------------------------------------------------------

    def save_pieces(self, block_ids: Sequence[int]) -> list[list[memoryview]]:
        """The payload pieces of each block, valid until the chunk's staging slot is used again."""
        return self.saved(self.start_save(block_ids))

    def start_save(self, block_ids: Sequence[int]) -> SaveTicket:
        """Device caches: queue the copy-out of up to ``chunk`` blocks into the next staging slot (asynchronous)."""
        ids = tuple(block_ids)
        if self.direct:
            return SaveTicket(-1, ids)
        if len(ids) > self.chunk:
            raise ValueError(f"{len(ids)} blocks do not fit a staging chunk of {self.chunk}")
        self.begin()
        rows = self._device()
        n, lw = len(ids), self._layer_words
        index = self._upload(ids)
        scratch = self._scratch_words[:n]
        for l, u in enumerate(self._words):  # noqa: E741
            self._gather(scratch[:, l * lw : (l + 1) * lw], u, index)
        rows = self._to_store_order(rows, n)  # converting (:mod:`.staged_order`): one permuted copy on the device
        held = self.sink.reserve(n, self._row_bytes) if self.sink is not None and self.order is not None else None
        if held is None:
            self._copy(self._rows[self._slot][:n], rows[:n])
        else:  # straight into the pool's slots: a block is one run, no host copy after
            import torch

            for r, payload in enumerate(held):
                self._copy(torch.from_numpy(payload), rows[r])
        self._held[self._slot] = held
        self._mark(self._slot)
        return SaveTicket(self._slot, ids)

    def saved(self, ticket: SaveTicket) -> list[list[memoryview]]:
        """The pieces of each block of ``ticket``, once its copies are done (the host waits on its event)."""
        if self.direct:
            lb = self.layer_bytes
            return [[m[b * lb : (b + 1) * lb] for m in self._flat] for b in ticket.block_ids]
        self._wait_slot(ticket.slot)
        held = self._held[ticket.slot]
        if held is not None:  # filled straight: stored by adopting the slot (HostPoolStore.put_many)
            return [[payload.data] for payload in held]
        rows = self._rows_np[ticket.slot]
        return [[memoryview(rows[i])] for i in range(len(ticket.block_ids))]

    # -- copies ---------------------------------------------------------------------------------

    def _upload(self, ids: Sequence[int]) -> torch.Tensor:
        """The chunk's block ids on the cache's device: written to this slot's pinned index, one copy."""
        n = len(ids)
        self._index_np[self._slot][:n] = ids
        index = self._index_dev[:n]
        self._copy(index, self._index[self._slot][:n])
        return index


class CacheIOs:
    """The cache access of one ``register_kv_caches`` and the staging :class:`CacheIO` s its background jobs take.

    A job takes a CacheIO of its own (:meth:`take`: on a CPU cache the shared one, on a device
    cache one with private host staging, reused job after job) and gives it back when done
    (:meth:`give_back`). A new registration makes a new ``CacheIOs``: jobs still running on the
    old one give their CacheIO back to the old object, which the worker no longer holds, so no
    new job ever copies into the caches of an earlier registration and the old caches and
    staging die with the last such job. The staging buffers are named ``<owner>/cache`` and
    ``<owner>/job<k>`` in ``buffers``, so the next registration's buffers replace them in the
    allocator's count instead of adding to it.
    """

    def __init__(
        self, caches: Sequence[torch.Tensor], layer_bytes: int, chunk: int, buffers: Staging | None, owner: str,
        staging: bool | None = None, device_chunk: int | None = None, sink: object = None,
        layout: KVCacheSpec | None = None,
    ) -> None:  # fmt: skip
        """``sink``: the store; when it lends slots (:class:`SlotSink`) device saves copy into them straight; with
        ``layout``, a staged cache's chunks go in the store's block order where it asks (:func:`staged_order`)."""
        self.caches = list(caches)
        self._args = (layer_bytes, chunk, buffers, owner, device_chunk)
        self._sink: SlotSink | None = sink if isinstance(sink, SlotSink) else None
        self.io = CacheIO(
            self.caches, layer_bytes, chunk, staging, buffers, owner=f"{owner}/cache", device_chunk=device_chunk
        )
        self._reorder = staged_order(sink, layout, not self.io.direct)
        self.io.sink, self.io.reorder = self._sink, self._reorder
        self._free: list[CacheIO] = []
        self._made = itertools.count()  # next() is atomic: load jobs take from their own threads

    def take(self) -> CacheIO:
        """Cache access for one background job: the cache itself (CPU) or a staging buffer of its own."""
        if self.io.direct:
            return self.io
        try:
            return self._free.pop()
        except IndexError:
            layer_bytes, chunk, buffers, owner, device_chunk = self._args
            name = f"{owner}/job{next(self._made)}"
            made = CacheIO(self.caches, layer_bytes, chunk, True, buffers, owner=name, device_chunk=device_chunk)
            made.sink, made.reorder = self._sink, self._reorder
            return made

    def give_back(self, io: CacheIO) -> None:
        """A job is done with ``io`` (from :meth:`take`)."""
        if io is not self.io:
            self._free.append(io)

    @property
    def idle(self) -> int:
        """Job CacheIOs given back and not taken again."""
        return len(self._free)


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
