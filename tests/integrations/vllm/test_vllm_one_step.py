"""Asynchronous loads in one engine step, idle steps that wait for them, and the pending-work hooks (vLLM-free).

The worker side runs kvdi's real store worker half over a real in-memory store; a load is
held back only by a gate the test opens (a slow medium, injected like any store).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvdi.connectors.base import SchedulerOutput
from kvdi.connectors.store import StoreTransferMetadata
from kvdi.errors import ConfigError
from kvdi.integrations.vllm.async_loads import WorkerLoads
from kvdi.integrations.vllm.fleet.stats import AdapterStats
from kvdi.integrations.vllm.pending import HeldSaves, wait_for_loads
from kvdi.settings import load_settings
from tests.helpers.store import DictStore, Engine, make_settings, request, small_layout

LAYOUT = small_layout(block_size=4)
PROMPT = request(range(18))  # 4 full blocks and 2 tokens
BLOCKS = (1, 2, 3, 4, 5)


class GatedReads(DictStore):
    """A store whose reads wait for ``gate`` (a medium slower than the engine step); remote, so loads are async."""

    prefers_async_load = True

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | bytearray | memoryview | None]:
        self.gate.wait()
        return super().get_many(keys)


def consumer_step(store: GatedReads) -> tuple[Engine, StoreTransferMetadata]:
    """A second engine whose scheduler accepted an asynchronous load of PROMPT; the worker started it."""
    Engine(store, LAYOUT, make_settings(), seed=1).prefill(PROMPT, BLOCKS)
    engine = Engine(store, LAYOUT, make_settings())
    assert engine.scheduler.get_num_new_matched_tokens(PROMPT, 0) == (16, True)
    engine.scheduler.update_state_after_alloc(PROMPT, BLOCKS, 16)
    meta = engine.scheduler.build_connector_meta(SchedulerOutput(1, ()))  # nothing else scheduled: idle
    assert isinstance(meta, StoreTransferMetadata) and len(meta.async_loads) == 1
    engine.worker.bind_connector_metadata(meta)
    engine.worker.start_load_kv()
    return engine, meta


def started(loads: WorkerLoads, meta: StoreTransferMetadata, idle: bool = True) -> None:
    loads.next_step(idle)
    for t in meta.async_loads:
        loads.started(t.request_id, t.block_ids, t.block_keys)


def test_a_load_that_finishes_during_the_step_is_reported_in_that_steps_get_finished() -> None:
    """The adapter's idle wait lets the load finish, and the same step's get_finished reports it: 1 step."""
    engine, meta = consumer_step(GatedReads())
    loads = WorkerLoads(AdapterStats(), idle_wait_s=10.0)
    started(loads, meta)

    wait_for_loads(engine.worker, loads)
    send, recv = loads.reconcile(*engine.worker.get_finished(set()))

    assert recv == {"r"} and send == set()
    assert engine.worker.get_block_ids_with_load_errors() == set()
    assert engine.worker.stats.loaded_blocks == 4
    assert (loads.counts.load_steps_1, loads.counts.async_load_steps, loads.counts.finished_recving) == (1, 1, 1)


def test_an_idle_step_waits_for_a_slow_load_and_returns_when_it_finishes() -> None:
    store = GatedReads()
    store.gate.clear()
    engine, meta = consumer_step(store)
    loads = WorkerLoads(AdapterStats(), idle_wait_s=30.0)
    started(loads, meta)
    opener = threading.Timer(0.05, store.gate.set)
    opener.start()

    wait_for_loads(engine.worker, loads)

    assert engine.worker.get_finished(set()) == (None, {"r"})
    assert loads.counts.idle_load_waits == 1
    assert 0 < loads.counts.idle_load_wait_seconds < 30.0  # it returned on the load, not on the bound
    opener.join()


@pytest.mark.parametrize(("idle", "wait_s", "waits"), [(True, 0.05, 1), (True, 0.0, 0), (False, 30.0, 0)])
def test_the_wait_is_bounded_only_on_idle_steps_and_zero_turns_it_off(idle: bool, wait_s: float, waits: int) -> None:
    """A load that does not finish: an idle step gives up after the bound; a busy step or a 0 bound never waits."""
    store = GatedReads()
    store.gate.clear()
    engine, meta = consumer_step(store)
    loads = WorkerLoads(AdapterStats(), idle_wait_s=wait_s)
    started(loads, meta, idle)

    wait_for_loads(engine.worker, loads)

    assert engine.worker.get_finished(set()) == (None, None)  # still loading: reported in a later step
    assert loads.counts.idle_load_waits == waits
    store.gate.set()
    engine.worker.shutdown()


def test_each_load_counts_the_engine_steps_it_spanned() -> None:
    loads = WorkerLoads(AdapterStats())
    loads.next_step(idle=True)
    loads.started("a", (1,), (b"a",))
    loads.started("b", (2,), (b"b",))
    assert loads.reconcile(None, {"a"}) == (set(), {"a"})  # the step that started it: 1
    loads.next_step(idle=False)
    loads.next_step(idle=False)
    loads.started("c", (3,), (b"c",))
    assert loads.reconcile(None, {"b", "c"}) == (set(), {"b", "c"})  # b: 3 steps, c: 1
    for _ in range(4):
        loads.next_step(idle=False)
    loads.started("d", (4,), (b"d",))
    loads.next_step(idle=False)
    loads.reconcile(None, {"d"})  # 2 steps
    c = loads.counts
    assert (c.load_steps_1, c.load_steps_2, c.load_steps_3, c.load_steps_4_or_more) == (2, 1, 1, 0)
    assert c.async_load_steps == 1 + 3 + 1 + 2


def test_held_saves_are_pending_block_frees_until_vllm_hears_they_were_sent() -> None:
    """Blocks held for queued saves are pending frees and push work until vLLM reports them sent."""
    held = HeldSaves(best_effort=True)
    assert not held.pending_block_frees() and not held.pending_push_work()
    assert held.finished("r", delay_free=True) is True
    assert held.finished("s", delay_free=False) is False  # not held: nothing to wait for
    assert held.pending_block_frees() and held.pending_push_work()
    held.sent({"r"})
    assert not held.pending_block_frees() and not held.pending_push_work()
    assert held.pending_push_work(prefetch_drops_due=True)  # staging of ended requests still to drop
    held.sent(None)  # vLLM's output without finished_sending


def test_a_store_is_best_effort_and_p2p_requires_delivery_and_never_blocks_preemption() -> None:
    """Store connectors are a best-effort cache; p2p delivers, and its held blocks never block preemption."""
    assert HeldSaves(best_effort=True).requires_kv_delivery is False
    p2p = HeldSaves(best_effort=False)
    assert p2p.requires_kv_delivery is True
    p2p.finished("r", delay_free=True)  # held until a peer pulls it, which may never happen
    assert not p2p.pending_block_frees() and p2p.pending_push_work()


def test_idle_load_wait_setting_is_bounded(kvdi_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().transfer.idle_load_wait_ms > 0  # on by default
    monkeypatch.setenv("KVDI_TRANSFER__IDLE_LOAD_WAIT_MS", "0")
    assert load_settings().transfer.idle_load_wait_ms == 0  # off
    for bad in ("-1", "1001", "nan"):
        monkeypatch.setenv("KVDI_TRANSFER__IDLE_LOAD_WAIT_MS", bad)
        with pytest.raises(ConfigError, match=f"KVDI_TRANSFER__IDLE_LOAD_WAIT_MS='{bad}'"):
            load_settings()
