"""Connector halves over a :class:`BlockStore`: shared by shared_storage, cpu_offload, redis and multi.

A BlockStore holds framed objects (see :mod:`kvdi.connectors.framing`) by block key and
knows nothing about tensors. The generic halves below do the rest: the scheduler half
asks the store how many leading blocks of a prompt it holds and plans loads and saves;
the worker half copies blocks between the paged KV cache and framed objects, verifies
every object it loads, and turns any bad object into a miss (counted, dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Protocol, cast, runtime_checkable

from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    ConnectorContext,
    KVConnectorMetadata,
    KVRequest,
    SchedulerConnector,
    SchedulerOutput,
    WorkerConnector,
    loadable_tokens,
)
from kvdi.connectors.framing import HEADER_SIZE, CorruptObjectError, frame_header, unframe, verify_pieces
from kvdi.connectors.keys import block_keys
from kvdi.connectors.plan import RequestPlan

if TYPE_CHECKING:
    import torch

    from kvdi.connectors.blockio import CacheIO

Buffer = bytes | bytearray | memoryview

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # payload bytes per store call (at least one block): stays in L2 between checksum and copy


@runtime_checkable
class BlockStore(Protocol):
    """Storage of framed blocks by key. Implementations must be safe to share by both halves of one engine.

    Failures of the medium (disk full, server gone) raise ``OSError`` (``ConnectionError``,
    ``TimeoutError`` are OSErrors) so callers can count them and carry on.
    """

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are present without a gap (an existence check only)."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The framed object of each key, or None where absent. One contiguous buffer per key."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> None:
        """Store each ``(key, pieces)``: the object is the concatenation of ``pieces`` (header, payload).

        Publishing is atomic per key: a reader sees the whole object or nothing.
        """
        ...

    def discard(self, key: bytes) -> None:
        """Remove one object (used to drop corrupt or foreign objects); absent keys are fine."""
        ...

    def close(self) -> None:
        """Release handles; called on container shutdown."""
        ...


@runtime_checkable
class ReadIntoStore(Protocol):
    """Optional extra a store may offer: read objects straight into caller buffers (no staging copy).

    The worker half uses it when present and falls back to :meth:`BlockStore.get_many` otherwise.
    """

    def get_into_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        """For each ``(key, pieces)``: the stored object's size, or None if absent.

        When the size equals the total size of ``pieces``, the object has been copied into
        them in order; otherwise ``pieces`` are left untouched.
        """
        ...


def require_store(context: ConnectorContext) -> BlockStore:
    """The context's backend as a BlockStore, or a TypeError naming the connector."""
    backend = context.backend
    if not isinstance(backend, BlockStore):
        raise TypeError(
            f"connector {context.name!r} needs a BlockStore backend (count_prefix, get_many, put_many, "
            f"discard, close), got {type(backend).__name__}"
        )
    return backend


class StoreSchedulerConnector(SchedulerConnector):
    """Offers the leading stored blocks of a prompt (consumers) and plans saves of new ones (producers)."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.store = require_store(context)
        self._block_size = context.layout.block_size
        self._plans: dict[str, RequestPlan] = {}

    def _plan(self, request: KVRequest) -> RequestPlan:
        plan = self._plans.get(request.request_id)
        if plan is None:
            keys = block_keys(request.prompt_token_ids, self.context.layout, request.cache_salt)
            plan = self._plans[request.request_id] = RequestPlan(keys)
        return plan

    def get_num_new_matched_tokens(self, request: KVRequest, num_computed_tokens: int) -> tuple[int, bool]:
        self.stats.lookups += 1
        plan = self._plan(request)
        plan.load_accepted = False
        plan.load_start = plan.load_end = 0
        bs = self._block_size
        try:
            plan.stored = self.store.count_prefix(plan.keys)  # all full blocks: none is saved twice
        except OSError as exc:
            logger.warning("kv connector %r: store lookup failed, treating as a miss: %s", self.name, exc)
            plan.stored = 0
        plan.saved = max(plan.saved, plan.stored)
        stored = min(plan.stored, loadable_tokens(len(request.prompt_token_ids), bs) // bs)
        first = num_computed_tokens // bs
        if not self.context.settings.is_consumer or stored * bs <= num_computed_tokens:
            return 0, False
        self.stats.lookup_hit_blocks += stored - first
        plan.load_from_tokens, plan.load_start, plan.load_end = num_computed_tokens, first, stored
        return stored * bs - num_computed_tokens, False

    def update_state_after_alloc(self, request: KVRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        plan = self._plans.get(request.request_id)
        if plan is None or plan.load_end <= plan.load_start:
            return
        if num_external_tokens <= 0:
            plan.load_start = plan.load_end = 0
            return
        covered = plan.load_from_tokens + num_external_tokens
        plan.load_end = min(plan.load_end, -(-covered // self._block_size))
        plan.load_accepted = True

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        loads: list[BlockTransfer] = []
        saves: list[BlockTransfer] = []
        producer = self.context.settings.is_producer
        bs = self._block_size
        for sched in output.scheduled:
            plan = self._plan(sched.request)
            rid = sched.request.request_id
            if plan.load_accepted:
                end = min(plan.load_end, len(sched.block_ids))
                if end > plan.load_start:
                    span = slice(plan.load_start, end)
                    loads.append(BlockTransfer(rid, tuple(sched.block_ids[span]), tuple(plan.keys[span])))
                plan.load_accepted = False
                plan.load_start = plan.load_end = 0
            if producer:
                prompt_len = len(sched.request.prompt_token_ids)
                done = min(sched.num_computed_tokens + sched.num_scheduled_tokens, prompt_len) // bs
                start = max(plan.saved, sched.num_computed_tokens // bs)
                end = min(done, len(sched.block_ids), len(plan.keys))
                if end > start:
                    span = slice(start, end)
                    saves.append(BlockTransfer(rid, tuple(sched.block_ids[span]), tuple(plan.keys[span])))
                plan.saved = max(plan.saved, end)
        for rid in output.finished_req_ids:
            self._plans.pop(rid, None)
        return BlockTransferMetadata(tuple(loads), tuple(saves))

    def request_finished(self, request: KVRequest, block_ids: Sequence[int]) -> tuple[bool, dict[str, object] | None]:
        self._plans.pop(request.request_id, None)
        return False, None


@dataclass
class _ReadChunk:
    """Blocks of one store call, read but not yet verified."""

    ids: Sequence[int]
    keys: Sequence[bytes]
    pieces: list[list[memoryview]]
    headers: list[bytearray]
    sizes: list[int | None]
    objects: list[Buffer | None]


class StoreWorkerConnector(WorkerConnector):
    """Copies blocks between the paged cache and framed objects; a bad object is a miss, never an exception.

    Transfers run in chunks of about :data:`CHUNK_BYTES`. With :attr:`io_thread` on (and a
    CPU cache), one I/O thread overlaps the store calls (which release the GIL: syscalls,
    memcpy) with checksumming (which holds it): while chunk ``k`` is verified, chunk ``k + 1``
    is read; while chunk ``k + 1`` is framed, chunk ``k`` is written. Both calls return only
    when all I/O is done.
    """

    io_thread: bool | None = False
    """Overlap store calls with checksums on a second thread (None: when 4+ CPUs are usable). Off by
    default: on the 2-CPU hosts measured so far, doing both in turn on one thread was faster (it keeps
    each block in L2 between checksum and copy); turn it on where spare cores exist and measure."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.store = require_store(context)
        self._read_into = isinstance(self.store, ReadIntoStore)  # a Protocol check is slow: once, here
        layout = context.layout
        self._fingerprint = layout.fingerprint()
        self._block_bytes = layout.block_bytes
        self._frame_bytes = HEADER_SIZE + layout.block_bytes
        self._chunk = max(1, CHUNK_BYTES // layout.block_bytes)
        self._io: CacheIO | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._logged: set[str] = set()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        from kvdi.connectors.blockio import CacheIO

        layout = self.context.layout
        names = [n for n in layout.layer_names if n in kv_caches]
        tensors = [kv_caches[n] for n in names] if len(names) == len(kv_caches) else list(kv_caches.values())
        self._io = CacheIO(tensors, layout.layer_block_bytes, self._chunk)

    def _cache(self) -> CacheIO:
        if self._io is None:
            raise RuntimeError(f"connector {self.name!r}: register_kv_caches() was not called before a transfer")
        return self._io

    def _background(self, io: CacheIO) -> ThreadPoolExecutor | None:
        """The I/O thread; None for device caches (their staging rows are reused chunk after chunk)."""
        from kvdi.connectors.blockio import usable_cpus

        use = self.io_thread if self.io_thread is not None else usable_cpus() >= 4
        if not io.direct or not use:
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kvdi-{self.name}-io")
        return self._executor

    def _log_once(self, reason: str, message: str, *args: object) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("kv connector %r: " + message + " (logged once per reason)", self.name, *args)

    # -- loads ---------------------------------------------------------------------------------

    def start_load_kv(self) -> None:
        meta = self.metadata
        if not isinstance(meta, BlockTransferMetadata) or not meta.loads:
            return
        io = self._cache()
        with self.stats.timed("load_seconds"):
            for transfer in meta.loads:
                self._load_request(io, transfer)

    def _load_request(self, io: CacheIO, transfer: BlockTransfer) -> None:
        ids, keys = transfer.block_ids, transfer.block_keys
        spans = [(s, min(s + self._chunk, len(ids))) for s in range(0, len(ids), self._chunk)]
        executor = self._background(io)
        ahead = executor.submit(self._read_chunk, io, ids[: spans[0][1]], keys[: spans[0][1]]) if executor else None
        for k, (start, end) in enumerate(spans):
            current = ahead
            if executor is not None and k + 1 < len(spans):
                nxt = spans[k + 1]
                ahead = executor.submit(self._read_chunk, io, ids[nxt[0] : nxt[1]], keys[nxt[0] : nxt[1]])
            else:
                ahead = None
            try:
                if current is None:
                    current_chunk = self._read_chunk(io, ids[start:end], keys[start:end])
                else:
                    current_chunk = current.result()
                good = self._verify_chunk(io, current_chunk)
            except OSError as exc:
                self.stats.load_failures += end - start
                self._log_once(f"oserror:{type(exc).__name__}", "loading KV failed, recomputing: %s", exc)
                good = 0
            io.finish()
            if start + good < end:
                if ahead is not None:
                    wait([ahead])  # it writes into blocks about to be recomputed: let it finish first
                self.report_load_error(ids[start + good :])
                return

    def _read_chunk(self, io: CacheIO, ids: Sequence[int], keys: Sequence[bytes]) -> _ReadChunk:
        pieces = [io.load_pieces(i, bid) for i, bid in enumerate(ids)]
        headers = [bytearray(HEADER_SIZE) for _ in ids]
        store = self.store
        if self._read_into and io.direct:
            targets = [(k, [memoryview(h), *p]) for k, h, p in zip(keys, headers, pieces, strict=True)]
            sizes = cast(ReadIntoStore, store).get_into_many(targets)
            objects: list[Buffer | None] = [None] * len(ids)
        else:
            objects = store.get_many(keys)
            sizes = [None if o is None else memoryview(o).nbytes for o in objects]
        return _ReadChunk(ids, keys, pieces, headers, sizes, objects)

    def _verify_chunk(self, io: CacheIO, chunk: _ReadChunk) -> int:
        """Check (and place) a read chunk; return how many leading blocks are in place."""
        for i, (bid, key) in enumerate(zip(chunk.ids, chunk.keys, strict=True)):
            size, obj = chunk.sizes[i], chunk.objects[i]
            try:
                if size is None:
                    self.stats.load_failures += 1
                    self._log_once("missing", "a stored block vanished before it was loaded (evicted?), recomputing")
                    return i
                if obj is None:  # read straight into the cache
                    if size != self._frame_bytes:
                        raise CorruptObjectError("length", f"object of {size} B, expected {self._frame_bytes} B")
                    verify_pieces(chunk.headers[i], chunk.pieces[i], self._fingerprint, self._block_bytes)
                else:
                    io.copy_payload(unframe(obj, self._fingerprint, self._block_bytes), chunk.pieces[i])
            except CorruptObjectError as exc:
                self.stats.corrupt_dropped += 1
                self._log_once(f"corrupt:{exc.reason}", "dropping a stored block: %s", exc)
                self._discard(key)
                return i
            io.commit_load(i, bid)
            self.stats.loaded_blocks += 1
            self.stats.loaded_bytes += self._block_bytes
        return len(chunk.ids)

    def _discard(self, key: bytes) -> None:
        try:
            self.store.discard(key)
        except OSError as exc:
            self._log_once("discard", "could not drop a corrupt block: %s", exc)

    # -- saves ---------------------------------------------------------------------------------

    def wait_for_save(self) -> None:
        meta = self.metadata
        if not isinstance(meta, BlockTransferMetadata) or not meta.saves:
            return
        io = self._cache()
        executor = self._background(io)
        with self.stats.timed("save_seconds"):
            ids = [b for t in meta.saves for b in t.block_ids]
            keys = [k for t in meta.saves for k in t.block_keys]
            writing: tuple[Future[None], int] | None = None
            for start in range(0, len(ids), self._chunk):
                items = self._frames(io, ids[start : start + self._chunk], keys[start : start + self._chunk])
                if executor is None:
                    self._settle(len(items), partial(self.store.put_many, items))
                    continue
                if writing is not None:
                    self._settle(writing[1], writing[0].result)
                writing = (executor.submit(self.store.put_many, items), len(items))
            if writing is not None:
                self._settle(writing[1], writing[0].result)

    def _frames(self, io: CacheIO, ids: Sequence[int], keys: Sequence[bytes]) -> list[tuple[bytes, Sequence[Buffer]]]:
        items: list[tuple[bytes, Sequence[Buffer]]] = []
        for piece_list, key in zip(io.save_pieces(ids), keys, strict=True):
            items.append((key, [frame_header(self._fingerprint, piece_list), *piece_list]))
        return items

    def _settle(self, count: int, finish: Callable[[], object]) -> None:
        """Run or wait for one put_many of ``count`` blocks and count the outcome; OSError is never raised."""
        try:
            finish()
        except OSError as exc:
            self.stats.save_failures += count
            self._log_once(f"save:{type(exc).__name__}", "saving KV failed, blocks not stored: %s", exc)
            return
        self.stats.saved_blocks += count
        self.stats.saved_bytes += count * self._block_bytes

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._io = None


__all__ = ["BlockStore", "ReadIntoStore", "StoreSchedulerConnector", "StoreWorkerConnector", "require_store"]
