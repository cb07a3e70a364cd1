"""``bench_serve --pin`` (vLLM-free): the server's non-worker processes go to the cores its workers leave, on real
processes and their real CPU affinity; nothing is pinned when the workers use every core."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from benchmarks.vllm.bench_serve_pin import apply, group_processes, is_engine_core, is_worker, placement, threads

CORES = set(range(os.cpu_count() or 1))
needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores")


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A real process in a session (and process group) of its own, with two threads."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def own_affinity() -> Iterator[None]:
    before = os.sched_getaffinity(0)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def test_the_others_get_the_cores_no_worker_uses_and_nothing_when_none_is_left() -> None:
    assert placement([{0}], {0, 1}) == {1}
    assert placement([{0}, {2}], {0, 1, 2, 3}) == {1, 3}
    assert placement([{0, 1}], {0, 1}) is None
    assert is_worker("VLLM::Worker") and is_worker("VLLM::Worker_TP1") and not is_worker("VLLM::EngineCor")


def test_the_group_lists_its_live_processes_by_name(sleeper: subprocess.Popen[bytes]) -> None:
    procs = group_processes(sleeper.pid)
    assert list(procs) == [sleeper.pid] and procs[sleeper.pid].startswith("python")
    assert group_processes(os.getpgid(0)).get(os.getpid()) is not None


@needs_two
def test_every_thread_of_a_non_worker_and_the_client_move_to_the_free_core(
    sleeper: subprocess.Popen[bytes], own_affinity: None
) -> None:
    worker = sorted(CORES)[0]
    for _ in range(100):  # the child's second thread starts with it
        if len(threads(sleeper.pid)) >= 2:
            break
        os.sched_yield()
    line = apply({sleeper.pid: "VLLM::EngineCor"}, {1: {worker}}, CORES)
    free = CORES - {worker}
    assert all(os.sched_getaffinity(tid) == free for tid in threads(sleeper.pid)), line
    assert os.sched_getaffinity(0) == free


@needs_two
def test_engine_on_worker_puts_the_engine_core_with_the_worker_and_the_rest_on_the_free_core(
    sleeper: subprocess.Popen[bytes], own_affinity: None
) -> None:
    worker = sorted(CORES)[0]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        line = apply({sleeper.pid: "VLLM::EngineCor", other.pid: "vllm"}, {1: {worker}}, CORES, engine_on_worker=True)
        assert all(os.sched_getaffinity(tid) == {worker} for tid in threads(sleeper.pid)), line
        assert os.sched_getaffinity(other.pid) == os.sched_getaffinity(0) == CORES - {worker}
        assert line.startswith("pin: worker and ") and "engine core threads on [" in line
    finally:
        other.kill()
        other.wait()
    assert is_engine_core("VLLM::EngineCor") and not is_engine_core("VLLM::Worker") and not is_engine_core("vllm")


def test_workers_on_every_core_leave_everything_where_it_was(
    sleeper: subprocess.Popen[bytes], own_affinity: None
) -> None:
    before = os.sched_getaffinity(sleeper.pid)
    line = apply({sleeper.pid: "VLLM::EngineCor"}, {1: CORES}, CORES)
    assert "left unpinned" in line
    assert os.sched_getaffinity(sleeper.pid) == before


@needs_two
def test_a_worker_is_never_moved(sleeper: subprocess.Popen[bytes], own_affinity: None) -> None:
    before = os.sched_getaffinity(sleeper.pid)
    apply({sleeper.pid: "VLLM::Worker"}, {sleeper.pid: {0}}, CORES | {0, 1})
    assert os.sched_getaffinity(sleeper.pid) == before


def test_noop2_is_the_do_nothing_connector_under_a_second_name(tmp_path: os.PathLike[str]) -> None:
    from pathlib import Path

    from benchmarks.vllm.bench_serve import kv_for

    store, stats = Path(tmp_path) / "s", Path(tmp_path) / "t"
    assert kv_for("noop2", store, "redis://x", stats) == kv_for("noop", store, "redis://x", stats) is not None
