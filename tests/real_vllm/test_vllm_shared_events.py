"""kvdi's events for a shared tier under a shared identity (``kvdi_events_identity``), with vLLM's own event types
and ZMQ publisher and a small llm-d-style indexer (:mod:`tests.real_vllm.indexer_support`); no engine runs.

Each "engine" is kvdi's real store halves over a real shared store (shared_storage, a folder:
``REMOTE``) or a host pool (cpu_offload: ``LOCAL``), driven a step at a time with vLLM's own
``Request`` (its block hashes), with kvdi's scheduler and worker fleet sides between them, as
the connector wires them. vLLM's publisher sends the engine's own events (``take_events``) on
``kv@<pod>@m``; kvdi's second publisher sends the shared tier's on ``kv@pool:fleet@m``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.real_vllm.vllm_support import require_vllm

require_vllm()

from kvdi.connectors.base import ScheduledRequest, SchedulerOutput, run_transfer_step  # noqa: E402
from kvdi.connectors.cpu_offload import HostPoolStore  # noqa: E402
from kvdi.connectors.shared_storage import FileBlockStore  # noqa: E402
from kvdi.errors import ConfigError  # noqa: E402
from kvdi.integrations.vllm.fleet.events import SchedulerFleet, WorkerFleet  # noqa: E402
from kvdi.integrations.vllm.parallel import RankSlice  # noqa: E402
from kvdi.integrations.vllm.requests import RequestTracker  # noqa: E402
from tests.helpers.store import Engine, make_settings, small_layout  # noqa: E402
from tests.real_vllm.indexer_support import Indexer  # noqa: E402

BS = 4
LAYOUT = small_layout(block_size=BS)
PROMPT = list(range(100, 118))  # 4 full blocks and 2 tokens
POOL = "pool:fleet"


def vllm_request(rid: str, tokens: list[int]) -> Any:
    """vLLM's own ``Request``, its block hashes computed by vLLM's hasher (sha256, as a vLLM engine's default)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)


def vllm_config(endpoint: str, pod: str, identity: str | None) -> Any:
    """The parts of vLLM's config kvdi's fleet side reads; ``--kv-events-config`` is vLLM's own ``KVEventsConfig``."""
    from vllm.config.kv_events import KVEventsConfig

    extra = {} if identity is None else {"kvdi_events_identity": identity}
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=f"kv@{pod}@m")
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        kv_events_config=events,
        parallel_config=SimpleNamespace(data_parallel_index=0),
        model_config=SimpleNamespace(served_model_name="m"),
    )


class FleetEngine:
    """One engine: kvdi's store halves, its fleet sides, and vLLM's publisher for the engine's own events."""

    def __init__(self, store: Any, endpoint: str, pod: str, identity: str | None) -> None:
        from vllm.distributed.kv_events import EventPublisherFactory

        self.engine = Engine(store, LAYOUT, make_settings())
        config = vllm_config(endpoint, pod, identity)
        self.fleet = SchedulerFleet(self.engine.scheduler, LAYOUT, RankSlice(), RequestTracker(), True, None, config)
        self.workers = WorkerFleet(self.engine.worker, RankSlice(), True)
        self.vllm_publisher = EventPublisherFactory.create(config.kv_events_config, 0)
        self.steps = 0

    def serve(self, request: Any) -> tuple[int, list[Any]]:
        """One prefill step of vLLM's ``request``; (tokens kvdi loaded, the engine's own events of it)."""
        from vllm.distributed.kv_events import KVEventBatch

        req = self.fleet.request(request)
        blocks = tuple(range(len(request.prompt_token_ids) // BS + 1))
        n, _ = self.engine.scheduler.get_num_new_matched_tokens(req, 0)
        self.fleet.looked_up(req, 0, n)
        self.engine.scheduler.update_state_after_alloc(req, blocks, n)
        self.steps += 1
        scheduled = ScheduledRequest(req, blocks, n, len(req.prompt_token_ids) - n)
        meta = self.engine.scheduler.build_connector_meta(SchedulerOutput(self.steps, (scheduled,)))
        self.fleet.planned(meta, ())
        self.workers.saw(meta)
        run_transfer_step(self.engine.worker, meta)
        self.engine.worker.flush()
        self.fleet.worker_events(SimpleNamespace(kv_cache_events=self.workers.kv_cache_events()))
        self.engine.scheduler.request_finished(req, blocks)
        self.fleet.planned(None, [req.request_id])
        events = self.fleet.take_events()
        self.vllm_publisher.publish(KVEventBatch(ts=time.time(), events=events))
        return n, events

    def close(self) -> None:
        self.fleet.close()
        self.vllm_publisher.shutdown()


@pytest.fixture
def indexers() -> Iterator[list[Indexer]]:
    made: list[Indexer] = []
    yield made
    for indexer in made:
        indexer.close()


def _serve_then_ask_a_fresh_indexer(tmp_path: Path, indexers: list[Indexer], identity: str | None) -> Indexer:
    """Engine 1 computes the prompt into a shared folder (its events to a first indexer); a fresh indexer subscribes
    to engine 2 only, which loads the prompt from the folder. Returns the fresh indexer, engine 2's events in it."""
    first = Indexer()
    fresh = Indexer()
    indexers.extend((first, fresh))
    one = FleetEngine(FileBlockStore(tmp_path / "kv"), first.endpoint, "pod-1", identity)
    two = FleetEngine(FileBlockStore(tmp_path / "kv"), fresh.endpoint, "pod-2", identity)
    try:
        first.wait_connected(2 if identity else 1)
        fresh.wait_connected(2 if identity else 1)
        computed, _ = one.serve(vllm_request("a", PROMPT))
        assert computed == 0
        first.wait_for(lambda: first.credited(PROMPT, BS) == {(POOL if identity else "pod-1"): 4})
        loaded, _ = two.serve(vllm_request("b", PROMPT))
        assert loaded == 16  # engine 2 computed none of the 4 blocks: it loaded them from the shared folder
    finally:
        one.close()
        two.close()
    return fresh


def test_a_fresh_indexer_credits_the_pool_with_blocks_only_the_first_engine_computed(
    tmp_path: Path, indexers: list[Indexer]
) -> None:
    """With ``pool:fleet``, engine 2's load is reported under the pool, with its tokens and parent hashes: an indexer
    that never saw engine 1's events keys all 4 blocks and credits them to the pool (every pod), none dropped."""
    fresh = _serve_then_ask_a_fresh_indexer(tmp_path, indexers, POOL)
    fresh.wait_for(lambda: fresh.credited(PROMPT, BS) == {POOL: 4})
    assert fresh.dropped == 0
    assert set(fresh.topics) == {"kv@pool:fleet@m", "kv@pod-2@m"}


def test_a_block_found_corrupt_on_load_is_withdrawn_from_the_pool(tmp_path: Path, indexers: list[Indexer]) -> None:
    """Engine 2's report of its load is withdrawn for a block the load finds corrupt: the pool keeps the first block
    only (a router's prefix stops at the corrupt one)."""
    from kvdi.connectors.store.keys import block_keys
    from kvdi.integrations.vllm.requests import kv_request

    indexer = Indexer()
    indexers.append(indexer)
    store = FileBlockStore(tmp_path / "kv")
    one = FleetEngine(store, indexer.endpoint, "pod-1", POOL)
    two = FleetEngine(FileBlockStore(tmp_path / "kv"), indexer.endpoint, "pod-2", POOL)
    try:
        indexer.wait_connected(4)
        one.serve(vllm_request("a", PROMPT))
        path = store.path_for(block_keys(PROMPT, LAYOUT, kv_request(vllm_request("x", PROMPT)).cache_salt)[1])
        path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
        two.serve(vllm_request("b", PROMPT))
    finally:
        one.close()
        two.close()
    indexer.wait_for(lambda: indexer.credited(PROMPT, BS) == {POOL: 1})


def test_without_the_option_a_fresh_indexer_learns_nothing_from_the_second_engine(
    tmp_path: Path, indexers: list[Indexer]
) -> None:
    """Off (the default): engine 1's store events go out with its own (pod-1), as before, and engine 2's load
    publishes nothing kvdi's, so the fresh indexer credits no one."""
    fresh = _serve_then_ask_a_fresh_indexer(tmp_path, indexers, None)
    fresh.wait_for(lambda: len(fresh.topics) >= 1)  # engine 2's (empty) batch arrived: everything before it did
    assert fresh.credited(PROMPT, BS) == {}
    assert set(fresh.topics) == {"kv@pod-2@m"}


def test_token_less_reports_of_unknown_blocks_are_dropped_by_the_indexer(indexers: list[Indexer]) -> None:
    """The rule the shared identity's reports are built for: the same block reported without tokens is dropped
    by a fresh indexer, and so is a child whose parent it never saw; with tokens from the first block, kept."""
    from vllm.distributed.kv_events import BlockStored

    request = vllm_request("r", PROMPT)
    h = request.block_hashes
    tokenless = BlockStored([h[0]], None, [], BS, None, "STORAGE", None)
    orphan = BlockStored([h[1]], h[0], PROMPT[BS : 2 * BS], BS, None, "STORAGE", None)
    full = BlockStored([h[0], h[1]], None, PROMPT[: 2 * BS], BS, None, "STORAGE", None)
    indexer = Indexer()
    indexers.append(indexer)
    indexer.apply(f"kv@{POOL}@m", [tokenless, orphan])
    assert (indexer.dropped, indexer.credited(PROMPT, BS)) == (2, {})
    indexer.apply(f"kv@{POOL}@m", [full, tokenless])
    assert (indexer.dropped, indexer.credited(PROMPT, BS)) == (2, {POOL: 2})


def test_a_local_tier_keeps_the_engines_identity(indexers: list[Indexer]) -> None:
    """cpu_offload (host memory, ``LOCAL``) with the option set: its events still go out with the engine's own,
    and nothing is published under the pool."""
    indexer = Indexer()
    indexers.append(indexer)
    engine = FleetEngine(HostPoolStore(16, 4096), indexer.endpoint, "pod-1", POOL)
    try:
        indexer.wait_connected(2)
        _, events = engine.serve(vllm_request("a", PROMPT))
    finally:
        engine.close()
    assert [(e.medium, e.locality) for e in events] == [("CPU", "LOCAL")] * 4
    indexer.wait_for(lambda: indexer.credited(PROMPT, BS) == {"pod-1": 4})
    assert "kv@pool:fleet@m" not in indexer.topics


def test_an_endpoint_vllm_binds_is_refused_with_the_option() -> None:
    """Two publishers cannot bind one address: the option needs vLLM to connect to the router (one line, the key)."""
    with pytest.raises(ConfigError, match=r"'kvdi_events_identity' is 'pool:fleet' but .* 'tcp://\*:5557'"):
        FleetEngine(HostPoolStore(16, 4096), "tcp://*:5557", "pod-1", POOL)


def test_lookahead_token_ids_are_filled_when_vllms_block_stored_has_the_field() -> None:
    """vLLM 0.33 appended ``lookahead_token_ids`` to ``BlockStored``: kvdi fills it there (None without lookahead
    hashing, the tokens after the block with it), and leaves it out on a ``BlockStored`` without the field."""
    from msgspec.msgpack import Decoder, Encoder
    from vllm.distributed.kv_events import BlockStored

    from kvdi.integrations.vllm.fleet.ledger import BlockFacts
    from kvdi.integrations.vllm.fleet.shared_tier import has_field, stored_event

    class BlockStored033(BlockStored, tag="BlockStored"):  # type: ignore[misc,call-arg]
        lookahead_token_ids: list[list[int]] | None = None

    facts = BlockFacts(b"h" * 32, None, (1, 2, 3, 4), None, None, None, (5,))
    assert not has_field(BlockStored, "lookahead_token_ids")  # vLLM 0.32, the one in this venv
    assert not hasattr(stored_event(facts, "STORAGE", "REMOTE", BS, (None, None)), "lookahead_token_ids")
    event = stored_event(facts, "STORAGE", "REMOTE", BS, (None, None), BlockStored033)
    assert Decoder(type=BlockStored033).decode(Encoder().encode(event)).lookahead_token_ids == [[5]]
    plain = stored_event(BlockFacts(b"h" * 32, None, (1, 2, 3, 4), None, None), "STORAGE", "REMOTE", BS, (None, None))
    assert Decoder(type=BlockStored).decode(Encoder().encode(plain)).token_ids == [1, 2, 3, 4]


def test_engines_with_the_same_number_of_resets_never_share_what_they_stored_after_it(
    tmp_path: Path, indexers: list[Indexer]
) -> None:
    """After ``reset_cache`` an engine's keys carry a nonce of its own, not just the count: two engines that reset
    once each (one may have new weights, the other not) load nothing of each other's later blocks; an engine still
    loads its own; what was stored before the reset is offered to neither."""
    first, second = Indexer(), Indexer()
    indexers.extend((first, second))
    one = FleetEngine(FileBlockStore(tmp_path / "kv"), first.endpoint, "pod-1", None)
    two = FleetEngine(FileBlockStore(tmp_path / "kv"), second.endpoint, "pod-2", None)
    try:
        assert one.serve(vllm_request("a", PROMPT))[0] == 0
        assert two.serve(vllm_request("b", PROMPT))[0] == 16  # before any reset the two engines share
        assert one.fleet.reset_cache() and two.fleet.reset_cache()
        assert one.serve(vllm_request("c", PROMPT))[0] == 0  # the reset: nothing stored before it is offered
        assert two.serve(vllm_request("d", PROMPT))[0] == 0  # same count of resets, not engine 1's blocks
        assert one.serve(vllm_request("e", PROMPT))[0] == 16  # an engine shares with itself after its reset
    finally:
        one.close()
        two.close()
