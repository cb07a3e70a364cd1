"""``--pin`` of :mod:`.bench_serve`: the same CPU placement for every ``vllm serve`` process, server after server.

vLLM-CPU binds its worker's OpenMP threads to the cores it picks (``VLLM_CPU_OMP_THREADS_BIND=auto``: core 0 on
the 2-core machine, core 1 reserved) and leaves the API server, the engine core and the benchmark client free to
run on every core, the worker's included. Where the kernel happens to place those processes is decided anew for
each server (wake-up affinity, load balancing) and then tends to stick: a server whose API server or engine core
keeps landing on the worker's core preempts its forward passes for the whole run, the next one does not. That is
a server-to-server difference that more passes per server cannot average out.

With ``--pin`` (off by default: the figures of earlier runs were measured without it), once a server is ready,
every thread of its other processes is moved to the cores the worker does not use (:func:`placement`), and so is
the benchmark's own process (the client; the multi-turn client's processes inherit it). A server is started with
every core allowed (:func:`allow_all`) so that vLLM's binding sees the machine whole, whatever the client's own
affinity is by then.

``--engine-on-worker`` (with ``--pin``) puts the engine core on the worker's cores instead, leaving the other
cores to the API server and the client. The engine core mostly waits for the worker, and waits spinning
(vLLM's ``SpinCondition``: ``sched_yield`` for a second after each read): next to the API server it takes that
core's time in proportion to how long the worker's steps run, whatever the worker does in them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

PROC = Path("/proc")


def placement(worker_cores: Iterable[set[int]], all_cores: set[int]) -> set[int] | None:
    """The cores for everything but the workers: every core no worker thread may run on; None when the workers
    use every core (nothing is left to pin to: the run goes on unpinned)."""
    used: set[int] = set().union(*worker_cores)
    free = all_cores - used
    return free or None


def group_processes(pgid: int, proc: Path = PROC) -> dict[int, str]:
    """``pid -> comm`` of every live process of process group ``pgid``."""
    out: dict[int, str] = {}
    for entry in proc.glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                out[int(entry.name)] = (entry / "comm").read_text().strip()
    return out


def is_worker(comm: str) -> bool:
    """A vLLM worker process (``VLLM::Worker``, ``VLLM::Worker_TP0``...): where vLLM binds OpenMP."""
    return comm.startswith("VLLM::Worker")


def threads(pid: int, proc: Path = PROC) -> list[int]:
    """The thread ids of ``pid`` (empty once it exited)."""
    with contextlib.suppress(OSError):
        return [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
    return []


def is_engine_core(comm: str) -> bool:
    """vLLM's engine core process (``VLLM::EngineCore``, cut to 15 characters by the kernel)."""
    return comm.startswith("VLLM::EngineCor")


def pin_server(pgid: int, engine_on_worker: bool = False) -> str:
    """Move every thread of the server's non-worker processes, and this process, to the cores its workers leave
    (the engine core's to the workers' own with ``engine_on_worker``); one line saying what was done (or why
    nothing was)."""
    procs = group_processes(pgid)
    workers = [pid for pid, comm in procs.items() if is_worker(comm)]
    if not workers:
        return "pin: no VLLM::Worker process in the server's group; left unpinned"
    affinity = {pid: os.sched_getaffinity(pid) for pid in workers}
    return apply(procs, affinity, set(range(os.cpu_count() or 1)), engine_on_worker)


def apply(
    procs: Mapping[int, str],
    worker_affinity: Mapping[int, set[int]],
    all_cores: set[int],
    engine_on_worker: bool = False,
) -> str:
    cores = placement(worker_affinity.values(), all_cores)
    if cores is None:
        return f"pin: the workers use every core ({sorted(all_cores)}); left unpinned"
    used = set().union(*worker_affinity.values())
    moved = engine = 0
    for pid, comm in procs.items():
        if is_worker(comm):
            continue
        on_worker = engine_on_worker and is_engine_core(comm)
        for tid in threads(pid):
            with contextlib.suppress(OSError):  # a thread that just exited
                os.sched_setaffinity(tid, used if on_worker else cores)
                moved += not on_worker
                engine += on_worker
    os.sched_setaffinity(0, cores)  # the client (this thread; new threads and processes inherit it)
    if engine_on_worker:
        return (f"pin: worker and {engine} engine core threads on {sorted(used)}; {moved} API server threads and "
                f"the client, on {sorted(cores)}")  # fmt: skip
    return (
        f"pin: worker on {sorted(used)}; {moved} API server and engine core threads and the client, on {sorted(cores)}"
    )


def allow_all() -> None:
    """In a server's child before exec: every core allowed again (the client may be pinned by now)."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


__all__ = ["allow_all", "apply", "group_processes", "is_engine_core", "is_worker", "pin_server", "placement", "threads"]
