"""What kvdi's scheduler side and counters do per engine step, counted (never timed), without vLLM.

An engine step where every running request decodes moves no block: the tracker and kvdi's
store scheduler half must do the same work for 1 running request as for 200 (calls of their
per-request functions, bytes of the metadata the workers get). Requests still in their prompt
are passed on until the step that computes their prompt's end, then settle.
"""

from __future__ import annotations

import gc
import pickle
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from kvdi.connectors.base import ConnectorStats, KVRequest
from kvdi.connectors.store import StoreSchedulerConnector, StoreTransferMetadata
from kvdi.integrations.vllm.fleet.counters import FleetCounters
from kvdi.integrations.vllm.fleet.stats import AdapterStats, StatsReporter, StepDeltas
from kvdi.integrations.vllm.requests import RequestTracker
from tests.helpers.store import DictStore, Engine, make_settings, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = 10  # two full blocks and two tokens


class Calls:
    """Counts calls of the wrapped bound methods, by name."""

    def __init__(self) -> None:
        self.n: dict[str, int] = {}

    def wrap(self, obj: Any, name: str) -> None:
        inner: Callable[..., Any] = getattr(obj, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.n[name] = self.n.get(name, 0) + 1
            return inner(*args, **kwargs)

        setattr(obj, name, counted)


def _new(rid: str, blocks: list[int], computed: int = 0) -> Any:
    return SimpleNamespace(
        req_id=rid, prompt_token_ids=list(range(PROMPT)), block_ids=(blocks,), num_computed_tokens=computed
    )


def _output(
    new: list[Any], cached: list[tuple[str, Any, int]], scheduled: dict[str, int], resumed: set[str] | None = None
) -> Any:
    data = SimpleNamespace(
        req_ids=[c[0] for c in cached],
        new_block_ids=[c[1] for c in cached],
        num_computed_tokens=[c[2] for c in cached],
        resumed_req_ids=resumed or set(),
    )
    return SimpleNamespace(
        scheduled_new_reqs=new, scheduled_cached_reqs=data, num_scheduled_tokens=scheduled, finished_req_ids=set()
    )


class Scheduler:
    """kvdi's store scheduler half behind the adapter's tracker, as :class:`SchedulerSide` wires them."""

    def __init__(self) -> None:
        self.half: StoreSchedulerConnector = Engine(DictStore(), LAYOUT, make_settings()).scheduler
        self.tracker = RequestTracker(prompt_only=True)

    def admit(self, rid: str, blocks: list[int]) -> Any:
        """vLLM's lookup and allocation of a new request (nothing stored: no load)."""
        req = KVRequest(rid, tuple(range(PROMPT)))
        self.tracker.remember(req)
        assert self.half.get_num_new_matched_tokens(req, 0) == (0, False)
        self.half.update_state_after_alloc(req, blocks, 0)
        return req

    def step(self, output: Any) -> StoreTransferMetadata:
        meta = self.half.build_connector_meta(self.tracker.translate(output))
        assert isinstance(meta, StoreTransferMetadata)
        return meta

    def count(self) -> Calls:
        calls = Calls()
        for name in ("_scheduled", "_set_blocks", "_add_blocks"):
            calls.wrap(self.tracker, name)
        calls.wrap(self.half, "_plan")
        return calls


def running(n: int) -> Scheduler:
    """``n`` requests whose whole prompt ran in one step (their blocks saved), now decoding."""
    sched = Scheduler()
    ids = [f"r{i}" for i in range(n)]
    news = []
    for i, rid in enumerate(ids):
        blocks = [3 * i, 3 * i + 1, 3 * i + 2]
        sched.admit(rid, blocks)
        news.append(_new(rid, blocks))
    meta = sched.step(_output(news, [], dict.fromkeys(ids, PROMPT)))
    assert len(meta.saves) == n and all(len(t.block_keys) == 2 for t in meta.saves)
    return sched


@pytest.mark.parametrize("new_blocks", [False, True], ids=["no-new-block", "every-request-grew-a-block"])
def test_a_decode_step_does_the_same_work_for_1_and_200_running_requests(new_blocks: bool) -> None:
    """Today's tracker passed every running request to the half each step: 200x the calls for 200 requests."""
    seen = []
    for n in (1, 200):
        sched = running(n)
        calls = sched.count()
        cached = [(f"r{i}", ([1000 + i],) if new_blocks else None, PROMPT + 4) for i in range(n)]
        meta = sched.step(_output([], cached, {f"r{i}": 1 for i in range(n)}))
        assert not (meta.loads or meta.saves or meta.async_loads)
        seen.append((dict(calls.n), len(pickle.dumps(meta))))
    assert seen[0] == seen[1]
    assert seen[0][0] == {}  # no per-request function ran at all


def test_a_chunked_prompt_is_passed_on_until_its_end_among_200_decoding_requests() -> None:
    sched = running(200)
    sched.admit("p", [900, 901])
    first = sched.step(_output([_new("p", [900, 901])], [], {"p": 6}))  # a chunk: block 0 full
    assert [t.block_keys for t in first.saves] == [tuple(sched.half._plans["p"].keys[:1])]
    calls = sched.count()
    decoding = [(f"r{i}", None, PROMPT + 1) for i in range(200)]
    cached = [*decoding[:100], ("p", ([902],), 6), *decoding[100:]]
    second = sched.step(_output([], cached, {**{f"r{i}": 1 for i in range(200)}, "p": 4}))
    assert [(t.request_id, t.block_ids) for t in second.saves] == [("p", (901,))]
    assert calls.n == {"_scheduled": 1, "_add_blocks": 1, "_plan": 1}  # only the request in its prompt
    assert "p" not in sched.tracker.in_prompt
    assert "p" in sched.tracker.blocks  # dropped a step later (a hybrid half reads them while it plans)
    sched.step(_output([], decoding, {f"r{i}": 1 for i in range(200)}))
    assert "p" not in sched.tracker.blocks and not sched.tracker.blocks


def test_a_settled_request_resumed_after_preemption_is_passed_on_with_its_full_blocks() -> None:
    sched = running(3)
    req = KVRequest("r1", tuple(range(PROMPT)))
    sched.half.get_num_new_matched_tokens(req, 0)
    sched.half.update_state_after_alloc(req, [7, 8, 9], 0)
    out = sched.tracker.translate(
        _output([], [("r0", None, 11), ("r1", ([7, 8, 9],), 0)], {"r0": 1, "r1": PROMPT}, {"r1"})
    )
    assert [(s.request.request_id, s.block_ids) for s in out.scheduled] == [("r1", (7, 8, 9))]


def test_without_prompt_only_every_scheduled_request_is_passed_on() -> None:
    """Another half (not kvdi's store, p2p, null or hybrid) sees every scheduled request, as before."""
    tracker = RequestTracker()
    tracker.remember(KVRequest("a", tuple(range(PROMPT))))
    tracker.translate(_output([_new("a", [1, 2, 3])], [], {"a": PROMPT}))
    out = tracker.translate(_output([], [("a", None, PROMPT)], {"a": 1}))
    assert [s.request.request_id for s in out.scheduled] == ["a"]


def nested_calls(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[str]]:
    """``fn(*args)`` and the Python functions it called (itself left out), counted with ``sys.setprofile``."""
    called: list[str] = []

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            called.append(frame.f_code.co_name)

    gc.disable()  # a collection's callbacks are no call of fn's
    sys.setprofile(count)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
        gc.enable()
    return result, called[1:]


def test_a_decode_step_of_200_requests_is_quiet_without_looking_at_any_request() -> None:
    """Before: every step was translated (a SchedulerOutput built, the tracker's helpers run, a frozenset built)."""
    sched = running(200)
    decoding = [(f"r{i}", None, PROMPT + 1) for i in range(200)]
    sched.step(_output([], decoding, {f"r{i}": 1 for i in range(200)}))  # settles the prompts' block lists
    step = sched.tracker.step
    quiet, called = nested_calls(sched.tracker.quiet, _output([], decoding, {f"r{i}": 1 for i in range(200)}))
    assert quiet and called == [] and sched.tracker.step == step + 1


@pytest.mark.parametrize("change", ["new", "resumed", "finished", "in-prompt"])
def test_a_step_with_a_request_to_pass_on_is_not_quiet(change: str) -> None:
    sched = running(3)
    sched.step(_output([], [(f"r{i}", None, PROMPT + 1) for i in range(3)], {f"r{i}": 1 for i in range(3)}))
    cached = [(f"r{i}", None, PROMPT + 2) for i in range(3)]
    scheduled = {f"r{i}": 1 for i in range(3)}
    output = _output([], cached, scheduled)
    if change == "new":
        sched.admit("n", [50, 51, 52])
        output = _output([_new("n", [50, 51, 52])], cached, {**scheduled, "n": PROMPT})
    elif change == "resumed":
        output = _output([], cached, scheduled, resumed={"r1"})
    elif change == "finished":
        output.finished_req_ids = {"r2"}
    else:
        sched.admit("p", [60, 61, 62])
        sched.step(_output([_new("p", [60, 61, 62])], cached, {**scheduled, "p": 4}))  # a chunk of its prompt
        output = _output([], [*cached, ("p", None, 4)], {**scheduled, "p": 4})
    assert not sched.tracker.quiet(output)


def test_counters_that_did_not_move_are_answered_without_another_python_call() -> None:
    """Before: each reporter built a snapshot tuple in a helper, and the Prometheus entry read every gauge source
    (even none) through two more helpers, every step on both roles."""
    half_stats, adapter = ConnectorStats(), AdapterStats()
    deltas = StepDeltas(StatsReporter(half_stats), StatsReporter(adapter))
    assert nested_calls(deltas.deltas) == ((None, None), [])
    assert nested_calls(StatsReporter(adapter).delta) == (None, [])
    counters = FleetCounters("scheduler", "0-0", None)  # a half with no gauge (the null half)
    assert counters.unmoved_is_empty
    assert nested_calls(counters.entry, None) == (None, [])
    adapter.finished_sending += 2
    half_stats.lookups += 1
    assert deltas.deltas() == ({"lookups": 1}, {"finished_sending": 2})
    assert deltas.deltas() == (None, None)
    counters.looked_up(prompt_tokens=9, num_computed_tokens=0, matched_tokens=0, block_size=4)
    assert counters.entry(None) == {"c|scheduler|lookup_miss_blocks": 2}
