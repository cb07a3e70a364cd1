"""Tensor and pipeline parallelism: each worker rank stores and loads its own slice of a block (vLLM-free).

With ``tensor_parallel_size`` or ``pipeline_parallel_size`` above 1 every worker rank holds
only its KV heads (TP) of its layers (PP). kvdi then stores one object per block per rank:

- the layout's model id carries the parallel shape (``@tp2pp1``) on both halves, so a
  TP=2 engine never shares keys with a TP=1 engine; a worker's layout also names its rank
  (``.rank1-0``), so the frame fingerprint of one rank's slice never matches another's;
- the worker re-keys each step's transfers with :meth:`RankSlice.key` (one key per rank
  per block, derived from the block key);
- the scheduler looks blocks up through :class:`AllRanksStore`: a block counts as stored
  only when every rank's slice is, so no request is offered a block some rank cannot load.
  A slice that vanishes anyway fails that rank's load; vLLM unions the failed block ids
  of all ranks and recomputes the block on every rank.

With ``format="canonical"`` on the store (shared_storage, redis, s3, or any tier of multi:
:func:`stores_canonical`) none of that applies: every shape names a block alike (the layout says
``#canonical``, the whole model, no shape), the worker's layout names its share of the model instead
of its rank, keys are never re-keyed, and the store
(:class:`~kvdi.connectors.store.canonical_store.CanonicalBlockStore`) finds the sections each rank
needs (docs/stored-format.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata
from kvdi.connectors.store.canonical_store import TAG, part_tag
from kvdi.connectors.store.protocol import BlockStore
from kvdi.connectors.store.scheduler import StoreTransferMetadata
from kvdi.integrations.vllm.config import written_kwargs
from kvdi.settings import KvdiSettings, load_settings


class KeyLookup(Protocol):
    """The part of a :class:`~kvdi.connectors.store.BlockStore` the scheduler half's lookups use."""

    def count_prefix(self, keys: Sequence[bytes]) -> int: ...

    def discard(self, key: bytes) -> None: ...


@dataclass(frozen=True)
class CanonicalShare:
    """The whole model's layers and KV heads and this rank's layers: what a canonical store needs to know."""

    num_layers: int
    num_kv_heads: int
    layer_start: int
    layer_count: int


def canonical_share(vllm_config: Any) -> CanonicalShare | None:
    """The whole model's layers and KV heads and this rank's layers when the engine stores canonical sections."""
    if getattr(vllm_config, "kv_transfer_config", None) is None:  # no connector configured: nothing is stored
        return None
    settings = load_settings(**written_kwargs(vllm_config))
    if not stores_canonical(settings):
        return None
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    start, end = model.get_layers_start_end_indices(parallel)
    heads = 1 if getattr(model, "use_mla", False) else int(model.get_total_num_kv_heads())
    return CanonicalShare(int(model.get_total_num_hidden_layers()), heads, int(start), int(end) - int(start))


def stores_canonical(settings: KvdiSettings) -> bool:
    """Whether the engine's connector keeps canonical sections: its own ``format`` (shared_storage, redis, s3)
    or, for ``multi``, any tier's (the whole composite then names blocks canonically: docs/stored-format.md)."""
    from kvdi.containers import connector_options, resolve_tiers
    from kvdi.registry import ConnectorRegistry

    registry = ConnectorRegistry()
    try:
        resolved = registry.resolve(settings.kv_connector, settings.kv_connector_module_path)
        options = connector_options(resolved, settings)
        tiers = resolve_tiers(registry, resolved, options, settings)
    except Exception:  # not resolvable here: the container reports why when it builds the connector
        return False
    formats = [getattr(options, "format", None), *(getattr(t.options, "format", None) for t in tiers)]
    return "canonical" in formats


@dataclass(frozen=True)
class RankSlice:
    """One worker rank's place in vLLM's parallel layout (all 1 / 0 when vLLM runs on one device);
    ``canonical`` when the store keeps canonical sections (shape-free keys and layouts)."""

    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    canonical: CanonicalShare | None = None

    @property
    def sliced(self) -> bool:
        """True when a block is split over more than one rank."""
        return self.tp_size > 1 or self.pp_size > 1

    def layout_tag(self) -> str:
        """Model-id suffix naming the parallel shape (empty for one rank; ``#canonical``, no shape, when canonical)."""
        if self.canonical is not None:
            return TAG
        return f"@tp{self.tp_size}pp{self.pp_size}" if self.sliced else ""

    def rank_tag(self) -> str:
        """Model-id suffix naming this rank within the shape (empty for one rank); canonical: its share of the
        model (:func:`~kvdi.connectors.store.canonical_store.part_tag`, after ``#canonical``)."""
        c = self.canonical
        if c is not None:
            tag = part_tag(c.layer_start, c.layer_count, c.num_layers, self.tp_rank, self.tp_size, c.num_kv_heads)
            return tag.removeprefix(TAG)
        return f".rank{self.tp_rank}-{self.pp_rank}" if self.sliced else ""

    def ranks(self) -> list[RankSlice]:
        """Every rank of this shape."""
        shape, canonical = (self.tp_size, self.pp_size), self.canonical
        return [RankSlice(*shape, t, p, canonical) for p in range(self.pp_size) for t in range(self.tp_size)]

    def key(self, block_key: bytes) -> bytes:
        """The key of this rank's slice of the block ``block_key`` (``block_key`` itself for one rank or canonical)."""
        if not self.sliced or self.canonical is not None:
            return block_key
        h = hashlib.blake2b(block_key, digest_size=len(block_key), person=b"kvdi-rank-slice")
        h.update(f"{self.tp_rank}/{self.tp_size}:{self.pp_rank}/{self.pp_size}".encode())
        return h.digest()

    def rekey(self, metadata: BlockTransferMetadata) -> BlockTransferMetadata:
        """``metadata`` with every block key replaced by this rank's slice key (as it is when canonical)."""
        if not self.sliced or self.canonical is not None:
            return metadata

        def each(transfers: Sequence[BlockTransfer]) -> tuple[BlockTransfer, ...]:
            return tuple(
                BlockTransfer(t.request_id, t.block_ids, tuple(self.key(k) for k in t.block_keys)) for t in transfers
            )

        if isinstance(metadata, StoreTransferMetadata):  # keep the asynchronous parts (loads reported later)
            return replace(
                metadata, loads=each(metadata.loads), saves=each(metadata.saves), async_loads=each(metadata.async_loads)
            )
        return BlockTransferMetadata(each(metadata.loads), each(metadata.saves))


class AllRanksStore:
    """The scheduler's view of a shared store holding per-rank slices: a block is there when every slice is.

    Wraps the real backend for lookups only (the scheduler half never reads or writes
    payloads); closing it leaves the backend to its owner.
    """

    def __init__(self, backend: BlockStore, shape: RankSlice) -> None:
        self.backend = backend
        self.ranks = [shape] if shape.canonical is not None else shape.ranks()  # canonical: one key, all sections

    def parts(self) -> list[BlockStore]:
        """:class:`~kvdi.connectors.store.CompositeStore`: the wrapped backend (its hit source and health)."""
        return [self.backend]

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        n = len(keys)
        for rank in self.ranks:
            if n == 0:
                break
            n = min(n, self.backend.count_prefix([rank.key(k) for k in keys[:n]]))
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[Any]:
        return [None] * len(keys)

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Any]]]) -> int:
        return 0  # never called by the scheduler half; the workers write their slices

    def discard(self, key: bytes) -> None:
        for rank in self.ranks:
            self.backend.discard(rank.key(key))

    def close(self) -> None:
        """Nothing: the wrapped backend belongs to the container."""
