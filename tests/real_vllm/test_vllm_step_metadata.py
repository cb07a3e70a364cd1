"""The scheduler side's per-step work and the metadata it pickles to the workers, counted (no engine starts).

kvdi's :class:`SchedulerSide` over its store scheduler half and vLLM's own ``SchedulerOutput`` types: a step where
every running request decodes calls none of the tracker's per-request functions and builds the same envelope
(67 bytes pickled) for 1 and for 200 running requests; an envelope that carries transfers arrives whole.
"""

from __future__ import annotations

import pickle
from typing import Any

from tests.integrations.vllm.test_vllm_step_cost import PROMPT, Calls
from tests.real_vllm.vllm_support import require_vllm
from tests.real_vllm.vllm_support import scheduler_output as _output

require_vllm()


def _side() -> Any:
    from kvdi.integrations.vllm.fleet.events import SchedulerFleet
    from kvdi.integrations.vllm.fleet.stats import AdapterStats
    from kvdi.integrations.vllm.parallel import RankSlice
    from kvdi.integrations.vllm.pending import HeldSaves
    from kvdi.integrations.vllm.requests import RequestTracker
    from kvdi.integrations.vllm.scheduler_side import SchedulerSide
    from tests.helpers.store import DictStore, Engine, make_settings, small_layout

    layout = small_layout(block_size=4)
    half = Engine(DictStore(), layout, make_settings()).scheduler
    tracker = RequestTracker()
    fleet = SchedulerFleet(half, layout, RankSlice(), tracker, events_on=False)
    return SchedulerSide(half, tracker, fleet, HeldSaves(best_effort=True), AdapterStats())


def _decode_step(n: int) -> tuple[dict[str, int], bytes]:
    """``n`` requests prefilled in one step, then one decode step: (tracker calls, pickled envelope)."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    from vllm.v1.request import Request

    side = _side()
    news = []
    for i in range(n):
        request = Request(f"r{i}", list(range(PROMPT)), SamplingParams(max_tokens=4), None)
        assert side.get_num_new_matched_tokens(request, 0) == (0, False)
        side.update_state_after_alloc(request, None, 0)
        news.append(NewRequestData.from_request(request, ([3 * i, 3 * i + 1, 3 * i + 2],)))
    ids = [f"r{i}" for i in range(n)]
    first = side.build_connector_meta(_output(news, CachedRequestData.make_empty(), dict.fromkeys(ids, PROMPT)))
    assert len(first.inner.saves) == n
    calls = Calls()
    for name in ("_scheduled", "_set_blocks", "_add_blocks"):
        calls.wrap(side._tracker, name)
    cached = CachedRequestData(
        req_ids=ids,
        resumed_req_ids=set(),
        new_token_ids=[[] for _ in ids],
        all_token_ids={},
        new_block_ids=[None] * n,
        num_computed_tokens=[PROMPT] * n,
        num_output_tokens=[1] * n,
    )
    meta = side.build_connector_meta(_output([], cached, dict.fromkeys(ids, 1)))
    return calls.n, pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)


def test_a_decode_step_builds_the_same_small_envelope_for_1_and_200_running_requests() -> None:
    """Before: the tracker's per-request function ran 200 times and the envelope pickled to 267 bytes."""
    one, many = _decode_step(1), _decode_step(200)
    assert one == many
    assert one[0] == {} and len(one[1]) <= 80


def test_envelopes_arrive_whole_at_the_workers() -> None:
    from kvdi.connectors.base import BlockTransfer, BlockTransferMetadata
    from kvdi.connectors.store import StoreTransferMetadata
    from kvdi.integrations.vllm.envelopes import EMPTY_INNER, KvdiConnectorMetadata

    save = BlockTransfer("a", (1, 2), (b"k1", b"k2"))
    for meta in (
        KvdiConnectorMetadata(),
        KvdiConnectorMetadata(StoreTransferMetadata(), idle=True),
        KvdiConnectorMetadata(BlockTransferMetadata(), unheld=("u",)),
        KvdiConnectorMetadata(StoreTransferMetadata(saves=(save,), async_save=True), preempted=("p",)),
    ):
        back = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
        assert back == meta and type(back.inner) is type(meta.inner)
    empty = pickle.loads(pickle.dumps(KvdiConnectorMetadata(StoreTransferMetadata())))
    assert empty.inner is EMPTY_INNER[0]


def test_another_scheduler_half_still_sees_every_scheduled_request() -> None:
    """Only kvdi's own halves (prompt blocks only) skip decoding requests; a half wrapping one does not."""
    from kvdi.integrations.vllm.scheduler_side import prompt_steps_only
    from kvdi.testing.recording import RecordingSchedulerConnector

    side = _side()
    assert side._tracker.prompt_only and prompt_steps_only(side.half)
    assert not prompt_steps_only(RecordingSchedulerConnector(side.half.context, side.half))
