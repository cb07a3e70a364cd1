"""kvdi seen by the fleet: KV cache events, hit sources, ``reset_cache``, metrics hooks (imports vLLM).

:class:`SchedulerFleet` and :class:`WorkerFleet` are collaborators of the adapter's scheduler and
worker sides (:mod:`kvdi.integrations.vllm.scheduler_side`, :mod:`kvdi.integrations.vllm.worker_side`),
which forward vLLM's fleet hooks to them.

**Events** (with ``--kv-events-config '{"enable_kv_cache_events": true, ...}'``), published by
vLLM's own publisher beside vLLM's GPU-block events:

- ``BlockStored`` when a block's save has *landed* in kvdi's store on every worker rank (each
  rank reports its slice through ``get_kv_connector_kv_cache_events``; the scheduler counts
  them, across steps, in :class:`~.event_ledger.SchedulerLedger`), carrying vLLM's own block
  hash (``request.block_hashes``, the hash vLLM publishes for its GPU block and a router
  computes from token ids), the parent hash, token ids, block size, LoRA and extra keys as
  vLLM fills them;
- ``BlockRemoved`` when a rank's store evicts the block (cpu_offload's LRU, shared_storage's
  size cap) or drops it as corrupt;
- on ``reset_cache`` (``reset_prefix_cache(reset_connector=True)``), one ``BlockRemoved`` per
  medium listing every block kvdi announced and has not announced removed since (kvdi does not
  publish ``AllBlocksCleared``: a router could not tell it from vLLM's own, which clears the
  engine's GPU blocks).

Every event kvdi publishes carries ``ownership="kvdi"`` (vLLM's field for "which secondary
tier generated this", as its own KVCR tier sets ``"kvcr"``), so a router tells kvdi's events
from vLLM's by a field, not by guessing from ``medium``; ``BlockStored`` also carries
``group_idx``, ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window`` of the KV cache
group, as vLLM's own offloading tier fills them.

``medium`` is ``CPU`` for host memory and ``STORAGE`` for disks and remote stores;
``locality`` is ``LOCAL`` for this engine's own host memory and ``REMOTE`` for shared stores
(shared_storage, Redis): any engine attached to the store can load the block, so a router
should not prefer this engine for it the way it prefers the engine whose GPU holds a block.

**Shared identity** (``kvdi_events_identity``: ``pool:<name>`` or ``node:<name>``; off by
default): kvdi's events for ``REMOTE`` tiers go out on their own topic ``kv@<identity>@<model>``
(:mod:`.shared_tier`) instead of with this engine's, and a load from a shared tier is reported
as a ``BlockStored`` there too, with its tokens: an indexer that restarted, or that only sees
engines that never computed the block, still keys it. Local tiers keep this engine's identity.

**reset_cache**: this engine stops being offered anything stored before the reset, and
nothing is deleted: its keys are salted with the number of resets and a nonce of this engine from
then on (others' blocks stay others'; engines that reset share nothing new with each other until they
restart, since the same count of resets does not mean the same weights).

**Hit sources**: ``get_external_cache_hit_sources`` splits a hit by the kind of tier that
serves it (a store's ``hit_source``: ``host``, ``disk``, ``p2p``; a remote store counts as
vLLM's ``external_unspecified``); for ``multi``, by the tier that holds each block.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict, deque
from dataclasses import replace
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvdi.connectors.base import (
    REMOTE_HIT_SOURCE,
    BlockEventSource,
    BlockTransferMetadata,
    DeclaresHitSource,
    KVRequest,
    SchedulerConnector,
    StoreHalf,
    WorkerConnector,
)
from kvdi.connectors.store.keys import block_keys
from kvdi.connectors.store.protocol import StoreCapabilities, leaf_stores
from kvdi.integrations.vllm.fleet.counters import FleetCounters
from kvdi.integrations.vllm.fleet.ledger import BlockFacts, SchedulerLedger, WorkerLedger, drain, sink
from kvdi.integrations.vllm.fleet.shared_tier import (
    OWNERSHIP,
    block_facts,
    lookahead_tokens,
    shared_tier_events,
    spec_kind,
    stored_event,
)
from kvdi.integrations.vllm.fleet.store_metrics import StoreCounters
from kvdi.integrations.vllm.parallel import RankSlice
from kvdi.integrations.vllm.requests import RequestTracker
from kvdi.layout import KVCacheSpec

_TRANSPORT_SIZE = -1  # block_size of worker-to-scheduler events: a kvdi key, not yet an event for routers
MAX_ANNOUNCED = 1 << 20
"""Blocks whose announcement a scheduler remembers for ``reset_cache`` (the oldest are forgotten past it)."""


def tier_of(store: object) -> tuple[str, str, str]:
    """(hit source, medium, locality) of one store: its declared ``hit_source``, a remote store by default."""
    source = StoreCapabilities.of(store).hit_source
    if source == CacheHitSource.HOST.value:
        return source, MEDIUM_CPU, "LOCAL"
    return source, MEDIUM_STORAGE, "REMOTE"


class KvdiKVEvents(KVConnectorKVEvents):  # type: ignore[misc,unused-ignore]
    """Worker-to-scheduler facts of one step, in vLLM's container (vLLM joins the ranks' lists)."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self.events = list(events or [])
        self.num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.events.extend(events)

    def aggregate(self) -> KvdiKVEvents:
        return self  # the scheduler counts ranks per block across steps (SchedulerLedger)

    def increment_workers(self, count: int = 1) -> None:
        self.num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self.events)

    def get_number_of_workers(self) -> int:
        return self.num_workers

    def clear_events(self) -> None:
        self.events.clear()


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (``--kv-events-config '{"enable_kv_cache_events": true}'``)."""
    events_config = getattr(vllm_config, "kv_events_config", None)  # vLLM's config
    return bool(events_config is not None and events_config.enable_kv_cache_events)


class SchedulerFleet:
    """The scheduler role's side of the fleet: vLLM's facts of planned saves joined with the ranks' reports into
    events for routers, ``reset_cache``, hit sources by tier, and its additions to the Prometheus entry."""

    def __init__(
        self,
        half: SchedulerConnector,
        layout: KVCacheSpec,
        shape: RankSlice,
        tracker: RequestTracker,
        events_on: bool,
        kv_cache_config: Any = None,
        vllm_config: Any = None,
    ) -> None:
        self.half, self.layout, self.shape, self.tracker, self.events_on = half, layout, shape, tracker, events_on
        self.kind = spec_kind(kv_cache_config)
        self.shared = shared_tier_events(vllm_config) if events_on else None  # kvdi_events_identity
        self._lookahead = lookahead_tokens(vllm_config)
        self._shared_out: list[KVCacheEvent] = []
        self._announced: OrderedDict[Any, tuple[str, str | None]] = OrderedDict()  # hash -> (medium, locality)
        self.counters = FleetCounters("scheduler", f"{shape.tp_rank}-{shape.pp_rank}", half)
        self._out: list[KVCacheEvent] = []
        self._resets = 0
        self._reset_salt = ""  # after a reset: its count and a nonce of this engine (see reset_cache)
        self._vllm_requests: dict[str, Any] = {}
        self._salted: dict[str, KVRequest] = {}
        self._lookups: dict[str, tuple[int, KVRequest]] = {}  # request id -> (computed tokens, kvdi's request)
        self._ledger = SchedulerLedger(shape.tp_size * shape.pp_size)
        # The stores behind the half, by kind of tier (hit sources), found once.
        store = half.store if isinstance(half, StoreHalf) else None
        leaves = leaf_stores(store) if store is not None else []
        self._hit_tiers = [(leaf, tier_of(leaf)[0]) for leaf in leaves]
        self._remote = [leaf for leaf in leaves if tier_of(leaf)[2] == "REMOTE"]
        self._hit_source = half.hit_source if isinstance(half, DeclaresHitSource) else None

    def request(self, request: Any) -> KVRequest:
        """kvdi's view of vLLM's ``request``, salted with the reset count and nonce after a ``reset_cache``."""
        req = self.tracker.request(request)
        if self.events_on:
            self._vllm_requests[req.request_id] = request
        if not self._resets:
            return req
        salted = self._salted.get(req.request_id)
        if salted is None:
            salt = f"{req.cache_salt or ''}|kvdi-reset:{self._reset_salt}"
            salted = self._salted[req.request_id] = replace(req, cache_salt=salt)
            self.tracker.remember(salted)
        return salted

    def looked_up(self, req: KVRequest, num_computed_tokens: int, matched: int | None) -> None:
        self.counters.looked_up(len(req.prompt_token_ids), num_computed_tokens, matched or 0, self.layout.block_size)
        self._lookups[req.request_id] = (num_computed_tokens, req)

    def planned(self, inner: object, finished: Any) -> None:
        """Capture vLLM's facts of this step's planned saves; forget requests that finished."""
        if self.events_on and isinstance(inner, BlockTransferMetadata):
            for transfer in inner.saves:
                for key, facts in self._facts(transfer.request_id, transfer.block_keys):
                    self._ledger.planned(key, facts)
            for transfer in inner.loads if self.shared is not None else ():
                self._reused(transfer.request_id, transfer.block_keys)
        for rid in finished or ():
            rid = str(rid)
            self._vllm_requests.pop(rid, None)
            self._salted.pop(rid, None)
            self._lookups.pop(rid, None)

    def _facts(self, request_id: str, keys: tuple[bytes, ...]) -> list[tuple[bytes, BlockFacts]]:
        """vLLM's facts of each of ``keys`` (blocks of the live request ``request_id``), in order."""
        request = self._vllm_requests.get(request_id)
        req = self._salted.get(request_id)
        if request is None:
            return []
        salt = req.cache_salt if req is not None else _kv_salt(request)
        prompt_keys = block_keys(request.prompt_token_ids, self.layout, salt)
        return block_facts(request, keys, prompt_keys, self.layout.block_size, self._lookahead)

    def _reused(self, request_id: str, keys: tuple[bytes, ...]) -> None:
        """Report the blocks a load takes from a shared tier as stored there, under the shared identity."""
        held = self._remote_held(keys)
        for key, facts in self._facts(request_id, keys[:held]):
            self._ledger.announce(key, MEDIUM_STORAGE, facts.block_hash)
            self._shared_out.append(stored_event(facts, MEDIUM_STORAGE, "REMOTE", self.layout.block_size, self.kind))

    def _remote_held(self, keys: tuple[bytes, ...]) -> int:
        """How many of ``keys`` (from the first) a shared tier holds: all with one shared store, else asked."""
        if not self._remote:
            return 0
        if len(self._hit_tiers) == 1:
            return len(keys)
        held = 0
        for leaf in self._remote:
            try:
                held = max(held, int(leaf.count_prefix(list(keys))))
            except Exception:
                continue
        return held

    def worker_events(self, connector_output: Any) -> None:
        """Turn the ranks' reports into events for routers (a block is stored once every rank's slice is)."""
        reported = getattr(connector_output, "kv_cache_events", None)
        if not isinstance(reported, KvdiKVEvents):
            return
        for event in reported.get_all_events():
            key = event.block_hashes[0] if isinstance(event, (BlockStored, BlockRemoved)) else None
            if not isinstance(key, bytes):  # the ranks' reports carry kvdi's block keys (bytes)
                continue
            if isinstance(event, BlockStored):
                facts = self._ledger.landed(key, str(event.medium), event.locality)
                if facts is None:
                    continue
                stored = stored_event(facts, event.medium, event.locality, self.layout.block_size, self.kind)
                if self._shared_tier(event.locality):
                    self._shared_out.append(stored)  # not withdrawn by this engine's reset_cache: others load it
                else:
                    self._announce(stored.block_hashes[0], str(event.medium), event.locality)
                    self._out.append(stored)
            elif isinstance(event, BlockRemoved):
                block_hash = self._ledger.removed(key, str(event.medium))
                if block_hash is not None:
                    ext = maybe_convert_block_hash(BlockHash(block_hash))
                    removed = BlockRemoved([ext], event.medium, 0, event.locality, ownership=OWNERSHIP)
                    if self._shared_tier(event.locality):
                        self._shared_out.append(removed)
                    else:
                        self._announced.pop(ext, None)
                        self._out.append(removed)

    def _shared_tier(self, locality: str | None) -> bool:
        """Whether an event of a tier at ``locality`` goes out under the shared identity."""
        return self.shared is not None and locality == "REMOTE"

    def _announce(self, block_hash: Any, medium: str, locality: str | None) -> None:
        self._announced[block_hash] = (medium, locality)
        self._announced.move_to_end(block_hash)
        if len(self._announced) > MAX_ANNOUNCED:
            self._announced.popitem(last=False)

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM's hook: kvdi's events since the last call (published with vLLM's own); those for shared tiers go to
        the shared identity's publisher instead when ``kvdi_events_identity`` is set."""
        if self.shared is not None and self._shared_out:
            shared, self._shared_out = self._shared_out, []
            self.shared.publish(shared)
        out, self._out = self._out, []
        return out

    def close(self) -> None:
        """Flush and close the shared identity's publisher, if any."""
        if self.shared is not None:
            self.take_events()
            self.shared.close()

    def reset_cache(self) -> bool:
        """vLLM's hook (``reset_prefix_cache(reset_connector=True)``): stop offering what was stored before it."""
        self._resets += 1
        # A nonce, not only the count: two engines with the same number of resets may serve different weights
        # (one slept with its weights unchanged, the other reset after an update), so after a reset an engine
        # shares its new blocks with nobody but itself until it restarts. Costs hits, never loads foreign KV.
        self._reset_salt = f"{self._resets}:{secrets.token_hex(8)}"
        self._salted.clear()
        self._ledger.clear()
        by_medium: dict[tuple[str, str | None], list[Any]] = {}
        for block_hash, where in self._announced.items():
            by_medium.setdefault(where, []).append(block_hash)
        self._announced.clear()
        for (medium, locality), hashes in by_medium.items():
            self._out.append(BlockRemoved(hashes, medium, 0, locality, ownership=OWNERSHIP))
        return True

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """vLLM's hook: ``num_external_tokens`` split by the kind of tier that serves them."""
        if num_external_tokens <= 0:
            return {}
        if len(self._hit_tiers) <= 1:  # one store, or a half without one (its own hit source, else remote)
            source = self._hit_source or (self._hit_tiers[0][1] if self._hit_tiers else REMOTE_HIT_SOURCE)
            return {CacheHitSource(source): num_external_tokens}
        return self._split_by_tier(str(request.request_id), num_external_tokens)

    def _split_by_tier(self, rid: str, tokens: int) -> dict[CacheHitSource, int]:
        computed, req = self._lookups.get(rid, (0, None))
        bs = self.layout.block_size
        keys = block_keys(req.prompt_token_ids, self.layout, req.cache_salt)[computed // bs :] if req else []
        out: dict[CacheHitSource, int] = {}
        served = 0
        for store, hit_source in self._hit_tiers:
            try:
                held = min(store.count_prefix(keys), -(-tokens // bs)) * bs
            except Exception:
                continue
            if held > served:
                source = CacheHitSource(hit_source)
                out[source] = out.get(source, 0) + min(held, tokens) - served
                served = min(held, tokens)
        if served < tokens:
            out[CacheHitSource.EXTERNAL_UNSPECIFIED] = tokens - served
        return out


class WorkerFleet:
    """One worker rank's side of the fleet: its landed, evicted and dropped blocks (by block key) for the scheduler,
    and its additions to the Prometheus entry (gauges). Watches the half and its stores when events are on."""

    def __init__(self, half: WorkerConnector, shape: RankSlice, events_on: bool) -> None:
        self.events_on = events_on
        store = half.store if isinstance(half, StoreHalf) else None
        leaves = leaf_stores(store) if store is not None else []
        self.counters = StoreCounters("worker", f"{shape.tp_rank}-{shape.pp_rank}", half, leaves)
        self._ledger = WorkerLedger([r.key for r in shape.ranks()] if shape.sliced else ())
        self._tiers: list[tuple[deque[bytes] | None, str, str]] = []  # (evicted keys, medium, locality) per leaf
        self._block_events: deque[tuple[bool, bytes]] = deque(maxlen=1 << 20)
        if events_on and isinstance(half, BlockEventSource):
            half.watch_blocks(lambda landed, key: self._block_events.append((landed, key)))
        for leaf in leaves:  # evictions are counted always, queued for events when they are on
            watch = StoreCapabilities.of(leaf).watch_evictions
            evicted = sink() if watch is not None and events_on else None
            if watch is not None:
                watch(self.counters.evictions(evicted))
            if events_on:
                self._tiers.append((evicted, *tier_of(leaf)[1:]))

    def saw(self, inner: object) -> None:
        """This step's metadata, before the adapter re-keys it per rank."""
        if self.events_on:
            self._ledger.saw(inner)

    def kv_cache_events(self) -> KvdiKVEvents | None:
        """vLLM's worker hook: this rank's landed, evicted and dropped blocks (by block key) since the last call."""
        if not self.events_on or not self._tiers:
            return None
        events: list[KVCacheEvent] = []
        reported = drain(self._block_events)
        landed = [k for ok, k in reported if ok]
        dropped = [k for ok, k in reported if not ok]
        for medium, locality in dict.fromkeys((m, loc) for _, m, loc in self._tiers):  # one report per kind
            events.extend(_transport_stored(k, medium, locality) for k in self._ledger.block_keys(landed))
            events.extend(BlockRemoved([k], medium, None, locality) for k in self._ledger.block_keys(dropped))
        for evicted, medium, locality in self._tiers:
            gone = drain(evicted)
            events.extend(BlockRemoved([k], medium, None, locality) for k in self._ledger.block_keys(gone))
        return KvdiKVEvents(events) if events else None


def _kv_salt(request: Any) -> str | None:
    from kvdi.integrations.vllm.requests import kv_salt

    return kv_salt(request)


def _transport_stored(key: bytes, medium: str, locality: str) -> BlockStored:
    return BlockStored([key], None, [], _TRANSPORT_SIZE, None, medium, None, locality=locality)


__all__ = ["OWNERSHIP", "KvdiKVEvents", "SchedulerFleet", "WorkerFleet", "events_enabled", "spec_kind", "tier_of"]
