"""Which report ends a request with an asynchronous load, as vLLM's scheduler requires (vLLM-free)."""

from __future__ import annotations

from kvdi.integrations.vllm.async_loads import SchedulerLoads, WorkerLoads


def test_a_request_resumed_after_its_load_keeps_kvdis_held_free() -> None:
    loads = SchedulerLoads()
    loads.offer("r", True)
    assert loads.allocated("r", 64)
    loads.scheduled(["r"])
    assert loads.finished("r", delay_free=True) is True
    assert loads.take_unheld() == ()


def test_a_request_finished_while_parked_is_not_held_and_goes_to_the_workers() -> None:
    loads = SchedulerLoads()
    loads.offer("r", True)
    assert loads.allocated("r", 64)
    assert loads.finished("r", delay_free=True) is False  # vLLM holds it until finished receiving
    assert loads.take_unheld() == ("r",) and loads.take_unheld() == ()


def test_a_synchronous_or_refused_offer_is_never_parked() -> None:
    loads = SchedulerLoads()
    loads.offer("s", False)
    assert not loads.allocated("s", 64)
    loads.offer("a", True)
    assert not loads.allocated("a", 0)  # vLLM allocated without external tokens: nothing to wait for
    assert loads.finished("a", delay_free=True) is True


def test_normal_async_load_reports_receiving_then_sending() -> None:
    worker = WorkerLoads()
    worker.started("r", (4, 5), (b"a", b"b"))
    assert worker.reconcile(None, {"r"}) == (set(), {"r"})
    assert worker.block_keys() == {4: b"a", 5: b"b"}  # its load errors may still be asked for this step
    worker.loaded.clear()
    assert worker.reconcile({"r"}, None) == ({"r"}, set())


def test_unheld_request_already_received_is_not_reported_again() -> None:
    worker = WorkerLoads()
    worker.started("r", (4,), (b"a",))
    assert worker.reconcile(None, {"r"}) == (set(), {"r"})  # vLLM failed it and freed it on this report
    worker.unheld(["r"])
    assert worker.reconcile({"r"}, None) == (set(), set())


def test_unheld_request_whose_load_ended_later_is_reported_as_received() -> None:
    worker = WorkerLoads()
    worker.started("r", (4,), (b"a",))
    worker.unheld(["r"])  # aborted while its load ran: the worker half reports it finished sending
    assert worker.reconcile({"r"}, None) == (set(), {"r"})
    assert worker.loaded == {"r": {4: b"a"}} and worker.loading == {}
