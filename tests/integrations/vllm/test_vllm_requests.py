"""vLLM requests and scheduler output as kvdi's (kvdi.integrations.vllm.requests), without vLLM.

The integration suite (tests/real_vllm/test_vllm_adapter.py) runs the same translation
over vLLM's own Request and SchedulerOutput types.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvdi.integrations.vllm.requests import RequestTracker, kv_request


def _request(rid: str = "r", tokens: list[int] | None = None, **extra: Any) -> Any:
    fields = {"cache_salt": None, "lora_request": None, "mm_features": [], **extra}
    return SimpleNamespace(request_id=rid, prompt_token_ids=[1, 2] if tokens is None else tokens, **fields)


def test_plain_request_has_tokens_and_no_salt() -> None:
    req = kv_request(_request())
    assert (req.request_id, req.prompt_token_ids, req.cache_salt) == ("r", (1, 2), None)


def test_tokens_of_any_integer_type_are_python_ints_and_key_the_same_blocks() -> None:
    """vLLM's list of ints is taken as it is; numpy integers, an array or a tuple give the same Python ints (and so
    the same block keys); no tokens (prompt embeddings) give none."""
    import numpy as np

    from kvdi.connectors.store.keys import block_keys
    from kvdi.layout import KVCacheSpec

    layout = KVCacheSpec("m", 2, 2, 8, 4, "float16")
    ids = list(range(7, 19))
    want = kv_request(_request(tokens=ids)).prompt_token_ids
    assert want == tuple(ids)
    for other in ([np.int64(t) for t in ids], np.asarray(ids, dtype=np.int32), tuple(ids), [*ids[:-1], np.int64(18)]):
        got = kv_request(_request(tokens=other)).prompt_token_ids  # type: ignore[arg-type]
        assert got == want and all(type(t) is int for t in got)
        assert block_keys(list(got), layout) == block_keys(ids, layout)
    assert kv_request(_request(tokens=[])).prompt_token_ids == ()


def test_salt_covers_cache_salt_lora_and_images() -> None:
    salted = kv_request(
        _request(
            cache_salt="t", lora_request=SimpleNamespace(lora_name="a"), mm_features=[SimpleNamespace(identifier="i")]
        )
    )
    assert salted.cache_salt == "s1:t|l1:a|m1:i"


def test_salt_parts_cannot_run_into_each_other() -> None:
    """A cache salt that spells another part's text gives another salt than that part."""
    tricky = kv_request(_request(cache_salt="x\x1flora=a"))
    split = kv_request(_request(cache_salt="x", lora_request=SimpleNamespace(lora_name="a")))
    assert tricky.cache_salt != split.cache_salt


def test_prompt_embeddings_give_no_tokens() -> None:
    assert kv_request(SimpleNamespace(request_id="e", prompt_token_ids=None)).prompt_token_ids == ()


def test_tracker_builds_one_kv_request_per_request_id() -> None:
    tracker = RequestTracker()
    vllm_request = _request()
    first = tracker.request(vllm_request)
    assert tracker.request(vllm_request) is first
    tracker.forget("r")
    assert tracker.request(vllm_request) is not first


def _output(new: list[Any], cached: Any, scheduled: dict[str, int], finished: set[str] | None = None) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        finished_req_ids=finished or set(),
    )


def _cached(req_ids: list[str], new_blocks: list[Any], computed: list[int], resumed: set[str] | None = None) -> Any:
    return SimpleNamespace(
        req_ids=req_ids, new_block_ids=new_blocks, num_computed_tokens=computed, resumed_req_ids=resumed or set()
    )


def test_tracker_rebuilds_full_block_lists_across_steps() -> None:
    tracker = RequestTracker()
    new = SimpleNamespace(req_id="a", prompt_token_ids=list(range(70)), block_ids=([4, 5],), num_computed_tokens=32)
    first = tracker.translate(_output([new], _cached([], [], []), {"a": 32}))
    assert first.scheduled[0].block_ids == (4, 5) and first.scheduled[0].num_computed_tokens == 32

    second = tracker.translate(_output([], _cached(["a"], [([9],)], [64]), {"a": 6}))
    assert second.scheduled[0].block_ids == (4, 5, 9) and second.scheduled[0].num_scheduled_tokens == 6

    resumed = tracker.translate(_output([], _cached(["a"], [([1, 2, 3],)], [0], {"a"}), {"a": 70}))
    assert resumed.scheduled[0].block_ids == (1, 2, 3)

    done = tracker.translate(_output([], _cached([], [], []), {}, {"a"}))
    assert done.finished_req_ids == frozenset({"a"}) and "a" not in tracker.blocks


def test_tracker_reuses_the_block_tuple_of_a_request_that_got_no_new_blocks() -> None:
    tracker = RequestTracker()
    new = SimpleNamespace(req_id="a", prompt_token_ids=[1] * 40, block_ids=([4, 5],), num_computed_tokens=0)
    first = tracker.translate(_output([new], _cached([], [], []), {"a": 40}))
    decode = tracker.translate(_output([], _cached(["a"], [None], [40]), {"a": 1}))
    assert decode.scheduled[0].block_ids is first.scheduled[0].block_ids
    assert decode.scheduled[0].request is first.scheduled[0].request


def test_tracker_keeps_every_kv_cache_groups_block_list() -> None:
    """With vLLM's hybrid manager each group has its own block ids; new blocks of any group are appended to it."""
    tracker = RequestTracker()
    new = SimpleNamespace(
        req_id="a", prompt_token_ids=list(range(70)), block_ids=([4, 5], [7, 8]), num_computed_tokens=0
    )
    tracker.translate(_output([new], _cached([], [], []), {"a": 64}))
    tracker.translate(_output([], _cached(["a"], [([], [9])], [64]), {"a": 6}))  # only the second group grew
    assert tracker.groups["a"] == [[4, 5], [7, 8, 9]] and tracker.blocks["a"] == [4, 5]
    tracker.translate(_output([], _cached(["a"], [([1], [2])], [0], {"a"}), {"a": 70}))  # resumed after preemption
    assert tracker.groups["a"] == [[1], [2]]
    tracker.translate(_output([], _cached([], [], []), {}, {"a"}))
    assert "a" not in tracker.groups
