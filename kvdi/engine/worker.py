"""The worker: owns the paged KV cache, runs the model, and drives the worker half of a KV connector.

Per step, in the order vLLM's ``KVConnectorBase_V1`` defines: bind metadata, start loads,
collect load errors, per layer wait for its load / attention / offer it for saving, wait
for saves, report finished transfers, clear metadata (always, even when the step raised).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvdi.allocator import GpuBufferAllocator
from kvdi.connectors.base import KVConnectorRole, ScheduledRequest, WorkerConnector, require_role
from kvdi.engine.model import SequenceChunk, TransformerModel
from kvdi.engine.scheduler import StepPlan, load_error_message
from kvdi.settings import KvdiSettings


@dataclass(frozen=True)
class WorkerOutput:
    """Results of one step.

    ``logits[rid]`` is the float32 logits row of the last computed token of each computed
    request. ``recomputed_tokens[rid]`` counts loaded tokens recomputed after a failed load
    (policy ``recompute``); ``failed[rid]`` is the error of a request dropped after a failed
    load (policy ``fail``). ``failed_block_ids`` are all block ids whose load failed.
    """

    logits: dict[str, torch.Tensor] = field(default_factory=dict)
    recomputed_tokens: dict[str, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    failed_block_ids: frozenset[int] = frozenset()
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()


class Worker:
    """Runs steps of the model over the allocator's caches; registers them with the connector once."""

    def __init__(
        self, connector: WorkerConnector, allocator: GpuBufferAllocator, model: TransformerModel, settings: KvdiSettings
    ) -> None:
        require_role(connector, KVConnectorRole.WORKER, "Worker")
        caches = allocator.kv_caches
        missing = [name for name in model.layer_names if name not in caches]
        if missing:
            raise ValueError(
                f"Worker needs an allocated GpuBufferAllocator; no cache for {missing} (call allocate() first)"
            )
        self.connector = connector
        self.model = model
        self.settings = settings
        self.block_size = allocator.spec.block_size
        self.kv_caches: dict[str, torch.Tensor] = {name: caches[name] for name in model.layer_names}
        connector.register_kv_caches(self.kv_caches)

    def execute(self, plan: StepPlan) -> WorkerOutput:
        """Run one step: connector loads, the forward pass over the scheduled chunks, connector saves."""
        c = self.connector
        c.bind_connector_metadata(plan.metadata)
        try:
            c.start_load_kv()
            failed_blocks = frozenset(c.get_block_ids_with_load_errors())
            chunks: list[SequenceChunk] = []
            ids: list[str] = []
            recomputed: dict[str, int] = {}
            failed: dict[str, str] = {}
            for sched in plan.output.scheduled:
                rid = sched.request.request_id
                bad = self._failed_loaded_blocks(sched, failed_blocks)
                start, tokens = sched.num_computed_tokens, plan.new_token_ids[rid]
                if bad and self.settings.kv_load_failure_policy == "fail":
                    failed[rid] = load_error_message(rid, [sched.block_ids[i] for i in bad])
                    continue
                if bad:
                    redo = min(bad) * self.block_size
                    tokens = sched.request.prompt_token_ids[redo:start] + tokens
                    recomputed[rid], start = start - redo, redo
                chunks.append(SequenceChunk(tokens, start, sched.block_ids))
                ids.append(rid)
            logits: dict[str, torch.Tensor] = {}
            if chunks:
                rows = self.model.forward(
                    chunks, self.kv_caches, before_attention=c.wait_for_layer_load, after_attention=self._offer_save
                )
                logits = dict(zip(ids, rows, strict=True))
            c.wait_for_save()
            sending, recving = c.get_finished(set(plan.output.finished_req_ids))
        finally:
            c.clear_connector_metadata()
        return WorkerOutput(
            logits, recomputed, failed, failed_blocks, frozenset(sending or ()), frozenset(recving or ())
        )

    def _failed_loaded_blocks(self, sched: ScheduledRequest, failed: frozenset[int]) -> list[int]:
        """Indices into the request's block table of blocks it had loaded and whose load failed."""
        if not failed:
            return []
        return [
            i for i, b in enumerate(sched.block_ids) if b in failed and i * self.block_size < sched.num_computed_tokens
        ]

    def _offer_save(self, layer_name: str) -> None:
        self.connector.save_kv_layer(layer_name, self.kv_caches[layer_name])
