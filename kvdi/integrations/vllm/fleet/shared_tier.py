"""kvdi's ``BlockStored`` as routers read it, and the shared identity its shared tiers are published under
(imports vLLM; see docs/events.md).

- :func:`stored_event`: one block's ``BlockStored`` with every self-describing field vLLM documents
  (vLLM's block hash, parent hash, token ids, block size, group, LoRA, extra keys, the KV cache
  group's spec kind) and, on a vLLM whose ``BlockStored`` has it (0.33), ``lookahead_token_ids``;
- :class:`SharedTierEvents`: with ``kvdi_events_identity`` (``pool:<name>`` or ``node:<name>``),
  a second publisher of vLLM's own kind and config that sends kvdi's events for shared tiers
  (``locality="REMOTE"``) on the topic ``kv@<identity>@<model>``. llm-d keys its block index by
  the topic's middle segment, and llm-d-router#2586 reads ``node:``/``pool:`` there as "every
  endpoint on that node" / "every endpoint of the pool", so a router credits the whole fleet for
  a block in a shared store instead of the one pod that wrote it.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import BlockStored, EventPublisherFactory, KVCacheEvent, KVEventBatch
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash, to_event_extra_keys

from kvdi.errors import ConfigError
from kvdi.integrations.vllm.config import EVENTS_IDENTITY_KEY, events_identity, shared_topic
from kvdi.integrations.vllm.fleet.ledger import BlockFacts

OWNERSHIP = "kvdi"
"""``ownership`` of every event kvdi publishes (vLLM's field naming the tier that generated an event)."""
LOOKAHEAD_FIELD = "lookahead_token_ids"
"""vLLM 0.33's trailing ``BlockStored`` field: the tokens after each block that its hash covers."""


def has_field(event_type: type, name: str) -> bool:
    """Whether vLLM's msgspec event type ``event_type`` has the field ``name`` (feature detection across versions)."""
    return name in getattr(event_type, "__struct_fields__", ())


def lookahead_tokens(vllm_config: Any) -> int:
    """Tokens after each block that vLLM's block hash covers (vLLM 0.33's ``num_hash_lookahead_tokens``; 0 before
    it, and 0 on 0.33 whenever a KV connector is configured: connectors keep the legacy hashes)."""
    try:
        return int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
    except Exception:  # a partial config (tests, older vLLM): no lookahead
        return 0


def spec_kind(kv_cache_config: Any) -> tuple[str | None, int | None]:
    """vLLM's ``kv_cache_spec_kind`` and sliding window of KV cache group 0 (the group kvdi's events name)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()  # vLLM's config
    if not groups:
        return None, None
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:  # a vLLM before spec kinds: its events carry none either
        return None, None
    spec = groups[0].kv_cache_spec
    return str(get_kv_cache_spec_kind(spec).value), get_kv_cache_spec_sliding_window(spec)


def block_facts(
    request: Any, keys: Sequence[bytes], prompt_keys: Sequence[bytes], bs: int, lookahead: int = 0
) -> list[tuple[bytes, BlockFacts]]:
    """vLLM's facts of each of ``keys`` that is a block of vLLM's ``request`` (``prompt_keys``: kvdi's keys of its
    prompt's blocks of ``bs`` tokens), in order: vLLM's own block hash and parent, tokens, LoRA and extra keys as
    vLLM publishes them for its GPU block (``lookahead``: tokens after a block its hash covers, vLLM 0.33)."""
    index = {k: i for i, k in enumerate(prompt_keys)}
    tokens, hashes = list(request.all_token_ids), request.block_hashes
    lora = getattr(request, "lora_request", None)
    out: list[tuple[bytes, BlockFacts]] = []
    for key in keys:
        i = index.get(key)
        if i is None or i >= len(hashes):
            continue
        end = (i + 1) * bs
        if lookahead:  # the extra keys cover the tokens after the block too, as vLLM's own events' do
            lookahead_keys = kv_cache_utils.generate_lookahead_block_hash_extra_keys  # type: ignore[attr-defined,unused-ignore]
            extra, _ = lookahead_keys(request, i * bs, end, end + lookahead, 0)  # vLLM 0.33's function
        else:
            extra, _ = kv_cache_utils.generate_block_hash_extra_keys(request, i * bs, end, 0)
        facts = BlockFacts(
            hashes[i],
            hashes[i - 1] if i else None,
            tuple(tokens[i * bs : end]),
            getattr(lora, "lora_name", None),
            getattr(lora, "adapter_id", None),
            to_event_extra_keys([extra]),
            tuple(tokens[end : end + lookahead]) if lookahead else None,
        )
        out.append((key, facts))
    return out


def stored_event(
    facts: BlockFacts,
    medium: str | None,
    locality: str | None,
    block_size: int,
    kind: tuple[str | None, int | None],
    event_type: type[BlockStored] = BlockStored,
) -> BlockStored:
    """One block's ``BlockStored``, self-describing: an indexer that never saw the block's parent computed can
    still key it from the tokens (llm-d drops a token-less event for a block it does not know)."""
    kwargs: dict[str, Any] = {}
    if has_field(event_type, LOOKAHEAD_FIELD):  # vLLM 0.33: None when the hash covers no lookahead, as vLLM's own
        kwargs[LOOKAHEAD_FIELD] = None if facts.lookahead is None else [list(facts.lookahead)]
    parent = facts.parent_hash
    return event_type(
        block_hashes=[maybe_convert_block_hash(BlockHash(facts.block_hash))],
        parent_block_hash=None if parent is None else maybe_convert_block_hash(BlockHash(parent)),
        token_ids=list(facts.token_ids),
        block_size=block_size,
        lora_id=facts.lora_id,
        medium=medium,
        lora_name=facts.lora_name,
        extra_keys=facts.extra_keys,
        group_idx=0,
        kv_cache_spec_kind=kind[0],
        kv_cache_spec_sliding_window=kind[1],
        locality=locality,
        ownership=OWNERSHIP,
        **kwargs,
    )


def binds(endpoint: str) -> bool:
    """Whether vLLM's ZMQ publisher binds ``endpoint`` (a wildcard, ipc or inproc address) rather than connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class SharedTierEvents:
    """kvdi's events for shared tiers, published on ``kv@<identity>@<model>`` by a publisher of vLLM's own kind
    (``EventPublisherFactory``) and config: same endpoint, high-water mark and data-parallel rank, no replay socket
    (vLLM's publisher binds that one).

    The second publisher connects where vLLM's connects (a router's bound socket, as llm-d's global
    ``zmqEndpoint``): two PUB sockets cannot bind one address, so an endpoint vLLM binds is refused.
    """

    def __init__(self, identity: str, events_config: Any, data_parallel_rank: int, model: str) -> None:
        endpoint = str(getattr(events_config, "endpoint", "") or "")
        if getattr(events_config, "publisher", "zmq") == "zmq" and binds(endpoint):
            raise ConfigError(
                f"kv_connector_extra_config key {EVENTS_IDENTITY_KEY!r} is {identity!r} but --kv-events-config "
                f"endpoint is {endpoint!r}, which vLLM binds: allowed an endpoint vLLM connects to "
                "(tcp://<router-host>:<port>, the router binds it), where kvdi connects a second publisher"
            )
        self.identity = identity
        self.topic = shared_topic(str(getattr(events_config, "topic", "") or ""), identity, model)
        config = dataclasses.replace(events_config, topic=self.topic, replay_endpoint=None)
        self._publisher = EventPublisherFactory.create(config, data_parallel_rank)
        self._close = weakref.finalize(self, self._publisher.shutdown)

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Publish ``events`` as one batch (nothing when there are none)."""
        if events:
            self._publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))  # type: ignore[arg-type,unused-ignore]

    def close(self) -> None:
        """Flush and close the publisher (also done when this object is collected, or at exit)."""
        self._close()


def shared_tier_events(vllm_config: Any) -> SharedTierEvents | None:
    """The shared-tier publisher ``kvdi_events_identity`` asks for; None when it is off or vLLM publishes no events."""
    identity = events_identity(vllm_config)
    events_config = getattr(vllm_config, "kv_events_config", None)
    if identity is None or events_config is None or not events_config.enable_kv_cache_events:
        return None
    parallel = getattr(vllm_config, "parallel_config", None)
    rank = getattr(parallel, "data_parallel_index", None)
    if rank is None:
        rank = getattr(parallel, "data_parallel_rank", 0)
    model_config = getattr(vllm_config, "model_config", None)
    model = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", None) or ""
    if isinstance(model, (list, tuple)):
        model = model[0] if model else ""
    return SharedTierEvents(identity, events_config, int(rank or 0), str(model))


__all__ = [
    "LOOKAHEAD_FIELD",
    "OWNERSHIP",
    "SharedTierEvents",
    "binds",
    "block_facts",
    "has_field",
    "lookahead_tokens",
    "shared_tier_events",
    "spec_kind",
    "stored_event",
]
