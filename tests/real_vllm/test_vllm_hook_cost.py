"""What kvdi ``null`` does per decode step in every hook vLLM calls, counted (never timed), beside vLLM's floor.

Both roles of each connector are built in this process by vLLM's own ``KVConnectorFactory`` from a real
``VllmConfig`` (no engine); each decode step goes through the hooks in the order of vLLM 0.32's scheduler and
model runner, the envelope pickled to the worker (:mod:`.hook_support`). Python function calls are counted with
``sys.setprofile``: the same on a quiet or a loaded machine. The do-nothing connector
(``benchmarks/vllm/noop_connector.py``) is vLLM's floor: one call per hook.
"""

from __future__ import annotations

import pickle
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvdi.testing.redis_server import RedisServer
from tests.real_vllm.vllm_support import require_vllm

require_vllm()

from tests.real_vllm.hook_support import LAYERS, SCHEDULER_HOOKS, WORKER_HOOKS, Pair, run_steps  # noqa: E402

STEPS = 40


@pytest.fixture(scope="module")
def pairs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Pair]]:
    work = tmp_path_factory.mktemp("hooks")
    built = {"noop": Pair("noop", tiny_model, 4, work), "null": Pair("null", tiny_model, 4, work)}
    built["null-64"] = Pair("null", tiny_model, 64, work, engine_id="hooks-null-64")
    yield built
    for pair in built.values():
        for connector in (pair.scheduler, pair.worker):
            connector.shutdown()


@pytest.fixture
def store_pairs(
    tiny_model: Path, tmp_path: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, Pair]]:
    """``shared_storage`` for 4 and 64 running requests and ``redis`` (a real server: breakers) for 4; shut down after
    the test (their prompts' saves started the save threads: the null test that follows must see none)."""
    built = {"4": Pair("shared_storage", tiny_model, 4, tmp_path)}
    (tmp_path / "64").mkdir()
    built["64"] = Pair("shared_storage", tiny_model, 64, tmp_path / "64", engine_id="hooks-shared-64")
    monkeypatch.setenv("KVDI_REDIS__URL", redis_server.url)
    built["redis"] = Pair("redis", tiny_model, 4, tmp_path, engine_id="hooks-redis")
    for pair in built.values():
        pair.worker.worker_side.half.flush()  # the prompts' saves written and collected, then reported: quiet from now
        for output in pair.outputs(2):
            pair.one_step(output)
    yield built
    for pair in built.values():
        for connector in (pair.scheduler, pair.worker):
            connector.shutdown()


def calls_per_hook(pair: Pair, steps: int = STEPS) -> dict[str, float]:
    """Python calls per step made inside each hook (the hook itself included)."""
    counts: dict[str, int] = {}
    current = [""]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts[current[0]] = counts.get(current[0], 0) + 1

    def wrap(obj: Any, hook: str) -> None:
        inner = getattr(obj, hook)

        def counted(*args: Any, **kwargs: Any) -> Any:
            current[0] = f"{'worker' if obj is pair.worker else 'sched'}.{hook}"
            sys.setprofile(count)
            try:
                return inner(*args, **kwargs)
            finally:
                sys.setprofile(None)

        setattr(obj, hook, counted)

    for hook in SCHEDULER_HOOKS:
        wrap(pair.scheduler, hook)
    for hook in WORKER_HOOKS:
        wrap(pair.worker, hook)
    try:
        run_steps(pair, steps)
    finally:
        for obj, hooks in ((pair.scheduler, SCHEDULER_HOOKS), (pair.worker, WORKER_HOOKS)):
            for hook in hooks:
                delattr(obj, hook)
    return {hook: n / steps for hook, n in counts.items()}


def test_per_layer_hooks_cost_null_what_they_cost_the_do_nothing_connector(pairs: dict[str, Pair]) -> None:
    """Before: three calls per layer and hook (the hook, the worker_side property, the side's method)."""
    null, noop = calls_per_hook(pairs["null"]), calls_per_hook(pairs["noop"])
    for hook in ("worker.wait_for_layer_load", "worker.save_kv_layer"):
        assert null[hook] == noop[hook] == len(LAYERS)


def test_a_decode_step_costs_null_the_same_for_4_and_64_running_requests_and_at_most_twice_the_floor(
    pairs: dict[str, Pair],
) -> None:
    """Before: 111 calls a step against the do-nothing connector's 22 (about 5x): the tracker's translation, the
    envelope built and compared field by field for the pickle, every counter read into tuples, the worker's
    bind, finish and clear all the way down to kvdi's half."""
    four, sixty_four, noop = (calls_per_hook(pairs[n]) for n in ("null", "null-64", "noop"))
    assert four == sixty_four
    assert sum(four.values()) <= 2 * sum(noop.values()), (four, noop)
    for hook in ("sched.build_connector_meta", "worker.bind_connector_metadata", "worker.get_transfer_results"):
        assert four[hook] <= 4, (hook, four[hook])


@pytest.mark.redis
def test_a_store_connectors_quiet_decode_step_costs_what_nulls_does(
    pairs: dict[str, Pair], store_pairs: dict[str, Pair]
) -> None:
    """Before: 75 calls a step against null's 44: the store scheduler planned an empty output (the deadline's sample,
    ``is_producer``, the lookup flush, the prefetcher: 8 calls), the worker harvested its empty queue twice (8) and
    read every gauge for the Prometheus entry (12), and asked its empty staging for prefetch reports (3). Then 46:
    the adapter still translated the quiet step for the store half and checked its answer (3), and asked for
    prefetch reports (1); redis 67: its breakers read every step on both roles (21); then 43: the scheduler's stats
    hook still asked its counters for an entry (1), where the adapter now reads the one breaker count itself."""
    store, store_64, redis, null = (
        calls_per_hook(store_pairs["4"]),
        calls_per_hook(store_pairs["64"]),
        calls_per_hook(store_pairs["redis"]),
        calls_per_hook(pairs["null"]),
    )
    assert store == store_64
    assert sum(store.values()) <= sum(null.values()), (store, null)
    assert sum(redis.values()) <= sum(null.values()), (redis, null)
    hooks = ("sched.build_connector_meta", "worker.build_connector_worker_meta", "worker.get_transfer_results")
    for hook in (*hooks, "worker.get_kv_connector_stats", "sched.get_kv_connector_stats"):
        assert store[hook] <= null[hook] and redis[hook] <= null[hook], (hook, store[hook], redis[hook], null[hook])


@pytest.mark.redis
def test_a_quiet_step_asks_the_store_half_only_when_it_is_due(store_pairs: dict[str, Pair]) -> None:
    """The adapter answers a quiet step for the store half with the shared envelope, unasked, except after a lookup,
    an allocation or a finished request: then the half plans (its lookups to flush, prefetches to send, staging to
    drop) and the step after is quiet again."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from kvdi.integrations.vllm.envelopes import moves_nothing

    pair = store_pairs["4"]
    half = pair.scheduler.scheduler_side.half
    inner, asked = half.build_connector_meta, []

    def plan(output: Any) -> Any:
        asked.append(output)
        return inner(output)

    half.build_connector_meta = plan
    try:
        assert moves_nothing(pair.scheduler.build_connector_meta(pair.outputs(1)[0])) and asked == []
        request = Request("looked-up", list(range(100, 164)), SamplingParams(max_tokens=4), None)
        pair.scheduler.get_num_new_matched_tokens(request, 0)
        assert half.due
        assert moves_nothing(pair.scheduler.build_connector_meta(pair.outputs(1)[0])) and len(asked) == 1
        assert not half.due
        assert moves_nothing(pair.scheduler.build_connector_meta(pair.outputs(1)[0])) and len(asked) == 1
    finally:
        del half.build_connector_meta


def test_a_step_that_moves_nothing_shares_one_envelope_and_leaves_kvdis_worker_half_alone(
    pairs: dict[str, Pair],
) -> None:
    pair = pairs["null"]
    half = pair.worker.worker_side.half
    bound: list[object] = []
    half.bind_connector_metadata = bound.append  # type: ignore[method-assign]
    try:
        output = pair.outputs(1)[0]
        meta = pair.scheduler.build_connector_meta(output)
        again = pair.scheduler.build_connector_meta(pair.outputs(1)[0])
        assert meta is again  # built once, shared by every step that moves nothing
        data = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        assert len(data) <= 80, data
        assert pickle.loads(data) is meta  # the worker knows it by identity
        pair.worker.bind_connector_metadata(pickle.loads(data))
        assert bound == []
        assert not pair.worker.worker_side.loads_due and not pair.worker.worker_side.saves_due
        assert pair.worker.get_kv_connector_stats() is None
        assert pair.scheduler.get_kv_connector_stats() is None
        results = pair.worker.get_transfer_results(set())
        assert (results.finished_sending, results.finished_recving, results.failed_recving) == (set(), set(), set())
        pair.worker.clear_connector_metadata()
    finally:
        del half.bind_connector_metadata


def test_null_starts_no_thread(pairs: dict[str, Pair]) -> None:
    assert pairs["null"].threads == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kvdi")]


def test_a_store_halfs_empty_metadata_gets_the_shared_envelope_without_a_python_call() -> None:
    """Before: the envelope compared kvdi's metadata with each empty kind through the dataclasses' ``__eq__``."""
    from kvdi.connectors.base import BlockTransfer
    from kvdi.connectors.store.scheduler import StoreTransferMetadata
    from kvdi.integrations.vllm.envelopes import empty_envelope, moves_nothing

    called: list[str] = []

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            called.append(frame.f_code.co_name)

    inner = StoreTransferMetadata(async_save=True)  # a store half's step that moves nothing
    sys.setprofile(count)
    try:
        shared = empty_envelope(inner)
    finally:
        sys.setprofile(None)
    assert called == ["empty_envelope"]
    assert moves_nothing(shared) and shared is not None and shared.inner == inner
    assert pickle.loads(pickle.dumps(shared)) is shared
    saving = StoreTransferMetadata(saves=(BlockTransfer("r", (1,), (b"k",)),), async_save=True)
    assert empty_envelope(saving) is None


def test_a_hook_of_the_other_role_still_raises_a_runtime_error_naming_both_roles(pairs: dict[str, Pair]) -> None:
    pair = pairs["null"]
    with pytest.raises(RuntimeError, match="built for the worker role was called as a scheduler"):
        pair.worker.build_connector_meta(pair.outputs(1)[0])
    with pytest.raises(RuntimeError, match="built for the scheduler role was called as a worker"):
        pair.scheduler.save_kv_layer(LAYERS[0], None, None)
