"""The scheduler: token budget, sequence limit, roles, delayed frees; the worker's connector protocol."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from dependency_injector import providers

from kvdi.connectors.base import ConnectorContext, KVConnectorMetadata, KVRequest, SchedulerOutput
from kvdi.connectors.null import NullSchedulerConnector, NullWorkerConnector
from kvdi.containers import EngineContainer
from kvdi.engine.engine import LLMEngine
from kvdi.engine.scheduler import Request, Scheduler
from kvdi.engine.worker import Worker
from kvdi.registry import ConnectorSpec
from kvdi.testing.recording import RecordingSchedulerConnector, RecordingWorkerConnector
from tests.helpers.engine import registry_with

Make = Callable[..., EngineContainer]
PROMPTS = [[i % 200 + 1] * (5 + 3 * i) for i in range(6)]


class DelayFreeScheduler(NullSchedulerConnector):
    """Asks the scheduler to hold a finished request's blocks until the worker half says so."""

    def request_finished(self, request: KVRequest, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        return True, None


class DelayFreeWorker(NullWorkerConnector):
    """Reports a finished request as sent the first time the worker asks."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return set(finished_req_ids), None


class ObservingScheduler(NullSchedulerConnector):
    """Keeps every SchedulerOutput it is given."""

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self.outputs: list[SchedulerOutput] = []

    def build_connector_meta(self, output: SchedulerOutput) -> KVConnectorMetadata:
        self.outputs.append(output)
        return super().build_connector_meta(output)


OBSERVING = ConnectorSpec("observing", f"{__name__}:ObservingScheduler", "kvdi.connectors.null:NullWorkerConnector")
DELAY_FREE = ConnectorSpec("delay_free", f"{__name__}:DelayFreeScheduler", f"{__name__}:DelayFreeWorker")
RECORDING = ConnectorSpec(
    "recording", "kvdi.testing.recording:RecordingSchedulerConnector", "kvdi.testing.recording:RecordingWorkerConnector"
)


def engine_with(make: Make, spec: ConnectorSpec, **overrides: Any) -> EngineContainer:
    return make(kv_connector=spec.name, registry=registry_with(spec), **overrides)


def scheduled_steps(make: Make, **overrides: Any) -> list[SchedulerOutput]:
    engine: LLMEngine = engine_with(make, OBSERVING, **overrides).engine()
    engine.generate(PROMPTS, 3)
    connector = engine.scheduler.connector
    assert isinstance(connector, ObservingScheduler)
    return [o for o in connector.outputs if o.scheduled]


def test_a_step_never_exceeds_max_num_batched_tokens(make_container: Make) -> None:
    steps = scheduled_steps(make_container, scheduler={"max_num_batched_tokens": 10, "max_num_seqs": 16})
    assert max(sum(s.num_scheduled_tokens for s in o.scheduled) for o in steps) == 10


def test_a_long_prompt_is_prefilled_in_chunks(make_container: Make) -> None:
    steps = scheduled_steps(make_container, scheduler={"max_num_batched_tokens": 10, "max_num_seqs": 16})
    longest = [s for o in steps for s in o.scheduled if len(s.request.prompt_token_ids) == len(PROMPTS[-1])]
    prefill = [s.num_scheduled_tokens for s in longest if s.num_computed_tokens < len(PROMPTS[-1])]
    assert len(prefill) >= 2 and max(prefill) <= 10 and sum(prefill) == len(PROMPTS[-1])


def test_a_step_never_runs_more_than_max_num_seqs(make_container: Make) -> None:
    steps = scheduled_steps(make_container, scheduler={"max_num_batched_tokens": 512, "max_num_seqs": 2})
    assert max(len(o.scheduled) for o in steps) == 2


def test_blocks_are_held_until_the_worker_reports_a_delayed_request(make_container: Make) -> None:
    engine = engine_with(make_container, DELAY_FREE).engine()
    engine.scheduler.add_request(Request("r0", (1, 2, 3, 4, 5), 1))
    finished = engine.step()
    assert [r.request_id for r in finished] == ["r0"]
    held = engine.block_pool.num_free
    engine.step()
    assert held < engine.block_pool.num_blocks and engine.block_pool.whole


def test_generate_returns_after_delayed_blocks_come_back(make_container: Make) -> None:
    engine = engine_with(make_container, DELAY_FREE).engine()
    engine.generate(PROMPTS, 2)
    assert engine.block_pool.whole


def test_scheduler_refuses_a_worker_connector(make_container: Make) -> None:
    container = make_container()
    worker_half = container.kv.worker_connector()
    with pytest.raises(TypeError, match="Scheduler needs a SchedulerConnector"):
        Scheduler(worker_half, container.alloc.plan(), container.settings())


def test_worker_refuses_a_scheduler_connector(make_container: Make) -> None:
    container = make_container()
    with pytest.raises(TypeError, match="Worker needs a WorkerConnector"):
        Worker(container.kv.scheduler_connector(), container.alloc.allocator(), container.model(), container.settings())


def test_worker_registers_the_allocator_caches_once(make_container: Make) -> None:
    container = engine_with(make_container, RECORDING)
    engine = container.engine()
    engine.generate(PROMPTS[:2], 2)
    engine.generate(PROMPTS[:2], 2)
    connector = engine.worker.connector
    assert isinstance(connector, RecordingWorkerConnector)
    log = connector.log
    assert log.methods("worker").count("register_kv_caches") == 1
    assert log.calls[0].args == (("layers.0", "layers.1"),)


def test_worker_calls_the_connector_in_vllm_order(make_container: Make) -> None:
    engine = engine_with(make_container, RECORDING).engine()
    engine.generate([PROMPTS[0]], 1)
    connector = engine.worker.connector
    assert isinstance(connector, RecordingWorkerConnector)
    step = connector.log.methods("worker")[1:]
    assert step == [
        "bind_connector_metadata",
        "start_load_kv",
        "get_block_ids_with_load_errors",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_finished",
        "clear_connector_metadata",
    ]


def test_scheduler_asks_the_connector_then_tells_it_the_blocks(make_container: Make) -> None:
    engine = engine_with(make_container, RECORDING).engine()
    engine.generate([PROMPTS[0]], 1)
    connector = engine.scheduler.connector
    assert isinstance(connector, RecordingSchedulerConnector)
    methods = connector.log.methods("scheduler")
    assert methods == [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
    ]


def test_building_the_scheduler_allocates_no_kv_cache(make_container: Make) -> None:
    container = make_container()
    container.scheduler()
    allocator = container.alloc.allocator
    assert isinstance(allocator, providers.Resource) and not allocator.initialized


def test_worker_runs_on_the_allocator_caches(make_container: Make) -> None:
    container = make_container()
    worker = container.worker()
    caches = container.alloc.allocator().kv_caches
    assert all(worker.kv_caches[name] is caches[name] for name in caches)


def test_engine_shutdown_shuts_both_halves_down_once(make_container: Make) -> None:
    engine: LLMEngine = engine_with(make_container, RECORDING).engine()
    engine.shutdown()
    engine.shutdown()
    scheduler, worker = engine.scheduler.connector, engine.worker.connector
    assert isinstance(scheduler, RecordingSchedulerConnector) and isinstance(worker, RecordingWorkerConnector)
    assert scheduler.log.methods().count("shutdown") == 1 and worker.log.methods().count("shutdown") == 1
