"""The parts of :mod:`kvdi.integrations.vllm` that need no vLLM: requests, block tracking, KV layouts.

- :func:`kv_request` / :class:`RequestTracker`: vLLM requests and scheduler output as kvdi's
  :class:`KVRequest` and :class:`SchedulerOutput` (cache salt, LoRA and multimodal hashes
  folded into the salt; each request's full block list tracked);
- :class:`BlockIndex`: the scheduler process's key-only view of a worker-local store;
- :func:`kvdi_layer_view` / :func:`ordered_layers` / :class:`LayoutBridge`: vLLM's paged KV
  tensors as kvdi's worker half addresses them, through a scratch cache when needed.

vLLM objects arrive here as plain attribute bags (typed ``Any``); this module never imports vLLM.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvdi.connectors.base import (
    BlockTransfer,
    BlockTransferMetadata,
    KVConnectorMetadata,
    KVRequest,
    ScheduledRequest,
    SchedulerOutput,
    WorkerConnector,
)
from kvdi.errors import ConfigError
from kvdi.layout import KVCacheSpec

# --------------------------------------------------------------------------- translation


def kv_request(request: Any) -> KVRequest:
    """kvdi's view of a vLLM ``Request``: id, prompt tokens, and a salt covering cache salt, LoRA and images.

    Requests with prompt embeddings instead of token ids get no tokens (never cached).
    """
    parts: list[str] = []
    salt = getattr(request, "cache_salt", None)
    if salt is not None:
        parts.append(f"salt={salt}")
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={getattr(lora, 'lora_name', lora)}")
    for feature in getattr(request, "mm_features", None) or ():
        parts.append(f"mm={getattr(feature, 'identifier', feature)}")
    tokens = getattr(request, "prompt_token_ids", None) or ()
    return KVRequest(str(request.request_id), tuple(int(t) for t in tokens), "\x1f".join(parts) if parts else None)


class RequestTracker:
    """What the scheduler half remembers per running request to rebuild kvdi's full :class:`ScheduledRequest`."""

    def __init__(self) -> None:
        self.requests: dict[str, KVRequest] = {}
        self.blocks: dict[str, list[int]] = {}
        self.step = 0

    def remember(self, request: KVRequest) -> None:
        self.requests[request.request_id] = request

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.blocks.pop(request_id, None)

    def translate(self, output: Any) -> SchedulerOutput:
        """kvdi's SchedulerOutput of one vLLM step; updates block lists (new requests, growth, resumption)."""
        scheduled: list[ScheduledRequest] = []
        for new in output.scheduled_new_reqs:
            req_id = str(new.req_id)
            request = self.requests.get(req_id)
            if request is None:
                request = KVRequest(req_id, tuple(new.prompt_token_ids or ()))
                self.requests[req_id] = request
            self.blocks[req_id] = list(new.block_ids[0]) if new.block_ids else []
            scheduled.append(self._scheduled(request, new.num_computed_tokens, output))
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self.requests.get(req_id)
            if request is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.blocks[req_id] = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                self.blocks.setdefault(req_id, []).extend(new_blocks[0])
            scheduled.append(self._scheduled(request, cached.num_computed_tokens[i], output))
        finished = frozenset(str(r) for r in output.finished_req_ids)
        for req_id in finished:
            self.forget(req_id)
        self.step += 1
        return SchedulerOutput(self.step, tuple(scheduled), finished)

    def _scheduled(self, request: KVRequest, num_computed: int, output: Any) -> ScheduledRequest:
        rid = request.request_id
        return ScheduledRequest(
            request, tuple(self.blocks.get(rid, ())), int(num_computed), int(output.num_scheduled_tokens.get(rid, 0))
        )


class BlockIndex:
    """The scheduler process's view of a worker-local store: a :class:`~kvdi.connectors.store.BlockStore` of keys only.

    Holds the keys the worker reported stored, least recently used first, at most
    ``capacity`` (the worker's pool size), and forgets keys the worker reported gone. When
    it is wrong (the pool evicted differently) the load fails, is reported, and vLLM
    recomputes: a lost hit, never wrong output.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):  # the head of a chain ends most recently used, as in the pool
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self._keys:
            n += 1
        for key in reversed(keys[:n]):
            self._keys.move_to_end(key)
        return n

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [None] * len(keys)  # the scheduler half never reads payloads

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Any]]]) -> None:
        self.add([key for key, _ in items])

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def close(self) -> None:
        self._keys.clear()


# --------------------------------------------------------------------------- layout


def kvdi_layer_view(cache: torch.Tensor, layout: KVCacheSpec, num_blocks: int | None = None) -> torch.Tensor:
    """One layer of vLLM's paged cache as kvdi's worker half addresses it: ``view[block_id]`` is that block.

    - vLLM's CPU backend ``[blocks, heads, block_size, 2 * head_dim]``: returned as is. Each
      block is contiguous and exactly ``layout.layer_block_bytes``, stored verbatim in the
      attention ISA's packing (see :func:`block_format_tag`).
    - ``[blocks, 2, block_size, heads, head_dim]`` (kvdi's order, FlashInfer NHD): as is.
    - ``[2, blocks, block_size, heads, head_dim]`` (FlashAttention NHD): a permuted, non-contiguous
      view in kvdi's order; :class:`LayoutBridge` copies such blocks through a scratch cache.

    Raises ConfigError naming the shape for anything else.
    """
    bs, heads, dim = layout.block_size, layout.num_kv_heads, layout.head_dim
    shape = tuple(cache.shape)
    if cache.dim() == 4 and shape[1:] == (heads, bs, 2 * dim) and cache.is_contiguous():
        return cache
    if cache.dim() == 5 and shape[2:] == (bs, heads, dim):
        if shape[1] == 2 and (num_blocks is None or shape[0] == num_blocks):
            return cache
        if shape[0] == 2:
            return cache.permute(1, 0, 2, 3, 4)
    raise ConfigError(
        f"KvdiConnector does not understand a paged KV tensor of shape {shape} (strides {tuple(cache.stride())}) "
        f"for block_size={bs}, kv_heads={heads}, head_dim={dim}; supported: vLLM's CPU backend and NHD layouts"
    )


def ordered_layers(names: Sequence[str]) -> list[str]:
    """vLLM's attention layer names in forward order (by the layer numbers in the names)."""

    def numbers(name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"(?<![A-Za-z_])\d+", name))

    return sorted(names, key=lambda n: (numbers(n), n))


class LayoutBridge:
    """Gives kvdi's worker half caches whose blocks are contiguous, copying through scratch only when needed.

    kvdi's store halves read and write each layer's block as one contiguous run of bytes.
    When every view from :func:`kvdi_layer_view` has contiguous blocks (``direct``: vLLM's
    CPU backend, NHD layouts with blocks outermost) the worker half gets vLLM's tensors and
    nothing is copied. Otherwise the worker half is given a small contiguous scratch cache in
    kvdi's order: each step's :class:`BlockTransferMetadata` is rewritten from vLLM block ids
    to scratch slots, blocks to save are gathered into scratch before the save, and loaded
    blocks are scattered into vLLM's cache after the load.
    """

    def __init__(self, views: Mapping[str, torch.Tensor], worker: WorkerConnector) -> None:
        self.views = dict(views)
        self.worker = worker
        self.direct = all(v.is_contiguous() for v in self.views.values())
        self.scratch: dict[str, torch.Tensor] = {}
        self._loads: list[tuple[int, int]] = []  # (vllm block id, scratch slot)
        self._saves: list[tuple[int, int]] = []
        self._slot_to_block: dict[int, int] = {}
        self._errors: set[int] = set()
        worker.register_kv_caches(self.views if self.direct else self._ensure_scratch(1))

    def _ensure_scratch(self, slots: int) -> dict[str, torch.Tensor]:
        have = next(iter(self.scratch.values())).shape[0] if self.scratch else 0
        if slots > have:
            size = max(slots, 2 * have)
            self.scratch = {
                name: torch.empty((size, *view.shape[1:]), dtype=view.dtype, device=view.device)
                for name, view in self.views.items()
            }
            if have:
                self.worker.register_kv_caches(self.scratch)
        return self.scratch

    def bind(self, metadata: KVConnectorMetadata) -> KVConnectorMetadata:
        """The metadata to hand kvdi's worker half for this step (block ids mapped to scratch slots)."""
        self._loads, self._saves, self._slot_to_block = [], [], {}
        if self.direct or not isinstance(metadata, BlockTransferMetadata):
            return metadata
        next_slot = 0

        def remap(transfers: Sequence[BlockTransfer], pairs: list[tuple[int, int]]) -> tuple[BlockTransfer, ...]:
            nonlocal next_slot
            out = []
            for t in transfers:
                slots = tuple(range(next_slot, next_slot + len(t.block_ids)))
                next_slot += len(slots)
                pairs.extend(zip(t.block_ids, slots, strict=True))
                out.append(BlockTransfer(t.request_id, slots, t.block_keys))
            return tuple(out)

        loads, saves = remap(metadata.loads, self._loads), remap(metadata.saves, self._saves)
        self._slot_to_block = dict((slot, block) for block, slot in self._loads)
        if next_slot:
            self._ensure_scratch(next_slot)
        return BlockTransferMetadata(loads, saves)

    def after_load(self) -> None:
        """Scatter the blocks kvdi loaded into scratch into vLLM's cache; remember failed vLLM block ids."""
        failed_slots = self.worker.get_block_ids_with_load_errors()
        if self.direct:
            self._errors |= failed_slots
            return
        self._errors |= {self._slot_to_block.get(s, s) for s in failed_slots}
        good = [(b, s) for b, s in self._loads if s not in failed_slots and b not in self._errors]
        if not good:
            return
        blocks = torch.tensor([b for b, _ in good], dtype=torch.long)
        slots = torch.tensor([s for _, s in good], dtype=torch.long)
        for name, view in self.views.items():
            src = self.scratch[name]
            view[blocks.to(view.device)] = src[slots.to(src.device)]

    def before_save(self) -> None:
        """Gather the blocks to save from vLLM's cache into scratch (kvdi's byte order)."""
        if self.direct or not self._saves:
            return
        blocks = torch.tensor([b for b, _ in self._saves], dtype=torch.long)
        slots = torch.tensor([s for _, s in self._saves], dtype=torch.long)
        for name, view in self.views.items():
            dst = self.scratch[name]
            dst[slots.to(dst.device)] = view[blocks.to(view.device)]

    def take_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        errors, self._errors = self._errors, set()
        return errors
