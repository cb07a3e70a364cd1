"""The vLLM adapter's translation pieces over vLLM's own types, without starting an engine (vLLM must be importable).

The same pieces are unit-tested without vLLM in tests/integrations/vllm/test_vllm_*.py; here
the inputs are vLLM's ``Request``, ``SchedulerOutput``, ``NewRequestData`` and
``CachedRequestData``, and the CPU cache is written by vLLM's own attention kernel.
"""

from __future__ import annotations

from typing import Any

from tests.real_vllm.vllm_support import require_vllm
from tests.real_vllm.vllm_support import scheduler_output as _output

require_vllm()

import torch  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvdi.integrations.vllm.envelopes import KvdiConnectorStats, KvdiWorkerMetadata  # noqa: E402
from kvdi.integrations.vllm.layout import kvdi_layer_view  # noqa: E402
from kvdi.integrations.vllm.requests import RequestTracker, kv_request  # noqa: E402
from kvdi.layout import KVCacheSpec  # noqa: E402

SPEC = KVCacheSpec("m", 2, 2, 32, 32, "float32")


def _request(rid: str, tokens: list[int], **kwargs: Any) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, **kwargs)


def _cached(
    req_ids: list[str], new_blocks: list[Any], computed: list[int], resumed: set[str] | None = None
) -> CachedRequestData:
    return CachedRequestData(
        req_ids=req_ids,
        resumed_req_ids=resumed or set(),
        new_token_ids=[[] for _ in req_ids],
        all_token_ids={},
        new_block_ids=new_blocks,
        num_computed_tokens=computed,
        num_output_tokens=[0 for _ in req_ids],
    )


def test_vllm_request_becomes_a_kv_request_with_its_salt() -> None:
    plain = kv_request(_request("r", [1, 2]))
    assert (plain.request_id, plain.prompt_token_ids, plain.cache_salt) == ("r", (1, 2), None)
    salted = kv_request(_request("s", [1], cache_salt="t", lora_request=LoRARequest("a", 1, "/nowhere")))
    assert salted.cache_salt == "s1:t|l1:a"  # kvdi.connectors.store.keys.compose_salt: tagged, length-prefixed parts


def test_tracker_rebuilds_full_block_lists_from_vllm_scheduler_output() -> None:
    tracker = RequestTracker()
    request = _request("a", list(range(70)))
    request.num_computed_tokens = 32
    kv = tracker.request(request)
    new = NewRequestData.from_request(request, ([4, 5],))

    first = tracker.translate(_output([new], CachedRequestData.make_empty(), {"a": 32}))
    assert first.scheduled[0].request is kv
    assert first.scheduled[0].block_ids == (4, 5) and first.scheduled[0].num_computed_tokens == 32

    second = tracker.translate(_output([], _cached(["a"], [([9],)], [64]), {"a": 6}))
    assert second.scheduled[0].block_ids == (4, 5, 9) and second.scheduled[0].num_scheduled_tokens == 6

    decode = tracker.translate(_output([], _cached(["a"], [None], [70]), {"a": 1}))
    assert decode.scheduled[0].block_ids is second.scheduled[0].block_ids

    resumed = tracker.translate(_output([], _cached(["a"], [([1, 2, 3],)], [0], {"a"}), {"a": 70}))
    assert resumed.scheduled[0].block_ids == (1, 2, 3)

    done = tracker.translate(_output([], CachedRequestData.make_empty(), {}, {"a"}))
    assert done.finished_req_ids == frozenset({"a"}) and "a" not in tracker.blocks


def test_cpu_cache_written_by_vllm_kernel_round_trips_through_kvdi_blocks() -> None:
    """vLLM's own CPU kernel writes K/V; kvdi's block i is exactly vLLM's block i, bytes and all."""
    from vllm import _custom_ops as ops

    nb, heads, bs, dim = 4, SPEC.num_kv_heads, SPEC.block_size, SPEC.head_dim
    cache = torch.zeros(nb, heads, bs, 2 * dim)
    key_cache, value_cache = cache.view(nb, heads, 2 * bs, dim).chunk(2, dim=2)
    slots = torch.arange(40) + 5
    ops.cpu_attn_reshape_and_cache(
        torch.randn(40, heads, dim), torch.randn(40, heads, dim), key_cache, value_cache, slots, "vec"
    )

    view = kvdi_layer_view(cache, SPEC)

    assert view.data_ptr() == cache.data_ptr() and view.is_contiguous()
    assert view[1].numel() * view.element_size() == SPEC.layer_block_bytes
    assert torch.equal(view[1], cache[1])


def test_stats_aggregate_by_connector_name() -> None:
    a = KvdiConnectorStats(data={"shared_storage": {"loaded_blocks": 2}})
    b = KvdiConnectorStats(data={"shared_storage": {"loaded_blocks": 3, "saved_blocks": 1}})
    merged = a.aggregate(b)
    assert merged.reduce() == {"shared_storage.loaded_blocks": 5, "shared_storage.saved_blocks": 1}
    assert not merged.is_empty() and KvdiConnectorStats().is_empty()


def test_worker_metadata_aggregates_across_workers() -> None:
    merged = KvdiWorkerMetadata((b"a",), ()).aggregate(KvdiWorkerMetadata((b"b",), (b"x",)))
    assert (merged.stored, merged.dropped) == ((b"a", b"b"), (b"x",))


def test_package_resolves_the_connector_class_for_vllm() -> None:
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    module = importlib.import_module("kvdi.integrations.vllm")
    assert issubclass(module.KvdiConnector, KVConnectorBase_V1)
