"""One connector's two roles built in this process as vLLM builds them, and decode steps through their hooks.

For tests/real_vllm/test_vllm_hook_cost.py and benchmarks/vllm/bench_hook_costs.py: :class:`Pair` creates the
scheduler and worker instances with vLLM's own ``KVConnectorFactory`` over a real ``VllmConfig`` of the tiny
Llama, admits ``n`` requests and runs their prompts, then :meth:`Pair.one_step` drives one decode step through
every hook vLLM 0.32's scheduler and model runner call per step, in their order, with the metadata envelope
pickled to the worker as vLLM's multiprocess executor does; :func:`run_steps` runs decode steps as both callers
count and time them. No engine, no forward pass.
"""

from __future__ import annotations

import gc
import pickle
import threading
from pathlib import Path
from typing import Any

BLOCK = 16
PROMPT = 64
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
NOOP = {
    "kv_connector": "NoopConnector",
    "kv_connector_module_path": "benchmarks.vllm.noop_connector",
    "kv_role": "kv_both",
}
SCHEDULER_HOOKS = ("build_connector_meta", "update_connector_output", "get_kv_connector_stats", "take_events")
SCHEDULER_HOOKS += ("has_pending_push_work",)
WORKER_HOOKS = ("bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer")
WORKER_HOOKS += ("wait_for_save", "get_transfer_results", "get_block_ids_with_load_errors", "get_kv_connector_stats")
WORKER_HOOKS += ("get_kv_connector_kv_cache_events", "build_connector_worker_meta", "clear_connector_metadata")


def transfer_config(name: str) -> dict[str, Any]:
    if name == "noop":
        return dict(NOOP)
    from tests.real_vllm.vllm_support import kv_config

    return kv_config(name)


class Pair:
    """One connector's scheduler and worker instances and ``n`` requests decoding through them."""

    def __init__(self, name: str, model: Path, n: int, workdir: Path, engine_id: str | None = None) -> None:
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        spec = transfer_config(name)
        spec["engine_id"] = engine_id or f"hooks-{name}"
        if name == "shared_storage":
            spec["kv_connector_extra_config"]["kvdi.shared_storage.path"] = str(workdir / name)
        config = VllmConfig(
            model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=512),
            cache_config=CacheConfig(block_size=BLOCK),
            kv_transfer_config=KVTransferConfig(**spec),
        )
        before = set(threading.enumerate())
        self.scheduler = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, None)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, None)
        self.threads = sorted(t.name for t in set(threading.enumerate()) - before)
        if name != "noop":  # vLLM's worker registers its caches ([2, blocks, block size, KV heads, head dim])
            import torch

            blocks = 5 * n + 8  # the prompts' blocks (decode steps move none)
            caches = {layer: torch.zeros(2, blocks, BLOCK, 2, 32) for layer in LAYERS}
            self.worker.register_kv_caches(caches)
        self.name, self.n, self.step, self.ids = name, n, 0, [f"r{i}" for i in range(n)]
        self.pickle, self.unpickle = pickle_envelope, unpickle_envelope
        self._prefill()

    def _prefill(self) -> None:
        from vllm import SamplingParams
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
        from vllm.v1.request import Request

        from tests.real_vllm.vllm_support import scheduler_output

        news = []
        for i, rid in enumerate(self.ids):
            request = Request(rid, list(range(i, i + PROMPT)), SamplingParams(max_tokens=4), None)
            self.scheduler.get_num_new_matched_tokens(request, 0)
            self.scheduler.update_state_after_alloc(request, _Blocks([]), 0)
            blocks = list(range(5 * i, 5 * i + 5))
            news.append(NewRequestData.from_request(request, (blocks,)))
        self.one_step(scheduler_output(news, CachedRequestData.make_empty(), dict.fromkeys(self.ids, PROMPT)))
        self.one_step(self.outputs(1)[0])  # the first decode step forgets the prompts' blocks: once, not per step

    def outputs(self, steps: int) -> list[Any]:
        """The next ``steps`` decode steps (one token per request, a new block every ``BLOCK`` steps)."""
        from vllm.v1.core.sched.output import CachedRequestData

        from tests.real_vllm.vllm_support import scheduler_output

        out = []
        for _ in range(steps):
            self.step += 1
            grow = self.step % BLOCK == 0
            cached = CachedRequestData(
                req_ids=self.ids,
                resumed_req_ids=set(),
                new_token_ids=[[] for _ in self.ids],
                all_token_ids={},
                new_block_ids=[([10_000 + self.step * self.n + i],) if grow else None for i in range(self.n)],
                num_computed_tokens=[PROMPT + self.step] * self.n,
                num_output_tokens=[self.step] * self.n,
            )
            out.append(scheduler_output([], cached, dict.fromkeys(self.ids, 1)))
        return out

    def one_step(self, output: Any) -> None:
        """One engine step as vLLM 0.32 calls the hooks (scheduler, pickled to the worker, worker, scheduler)."""
        from vllm.v1.outputs import KVConnectorOutput

        sched, worker = self.scheduler, self.worker
        meta = sched.build_connector_meta(output)
        meta = self.unpickle(self.pickle(meta))
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for layer in LAYERS:
            worker.wait_for_layer_load(layer)
            worker.save_kv_layer(layer, None, None)
        worker.wait_for_save()
        results = worker.get_transfer_results(output.finished_req_ids)
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=worker.get_kv_connector_stats(),
            kv_cache_events=worker.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        sched.update_connector_output(connector_output)
        sched.get_kv_connector_stats()
        sched.take_events()
        sched.has_pending_push_work()


def run_steps(pair: Pair, steps: int) -> None:
    """``steps`` decode steps of ``pair`` through every hook, with the garbage collector collected first and off
    while they run: a collection's callbacks (vLLM registers some) are no call, and no time, of the connector's."""
    outputs = pair.outputs(steps)
    gc.collect()
    gc.disable()
    try:
        for output in outputs:
            pair.one_step(output)
    finally:
        gc.enable()


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def pickle_envelope(meta: Any) -> bytes:
    return pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)


def unpickle_envelope(data: bytes) -> Any:
    return pickle.loads(data)
