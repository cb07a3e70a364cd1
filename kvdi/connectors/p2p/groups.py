"""The two-rank process group of a p2p pair: creation, bounded waits, and draining it on failure.

- **gloo** (a CPU cache, or a CUDA cache staged through host memory): every send and receive is
  bounded by the group's timeout (``KVDI_P2P__TIMEOUT_S``); a timed-out receive closes the pair.
- **NCCL** (a CUDA cache): ``Work.wait`` only makes the current CUDA stream wait, it never bounds
  the host, so :func:`wait_work` polls ``is_completed`` against the deadline. torch's default
  NCCL error handling tears the whole process down when an operation fails or times out
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 3); this group is created with ``2`` ("clean up only":
  the watchdog aborts the communicator, the error reaches :func:`wait_work`) so a dead or
  stalled peer breaks the channel and the engine lives on. The communicator is created at
  pairing (one warm-up message, on the thread that pairs, within ``connect_timeout_s``), not
  lazily inside the first fetch on whichever thread gets there.
- After a failed fetch, receives still posted (into the KV cache, or into staging) must never
  land late in blocks the engine recomputes or reuses. gloo's ``abort()`` is a no-op (torch binds
  no ``Work.abort()`` either), so :func:`settle` waits for each posted gloo receive, up to the
  fetch's deadline and at least :data:`SETTLE_MIN_S`: it lands now, before the blocks go back to
  the engine, or its wait times out, and a gloo timeout closes the pair's connections, so it
  never lands. NCCL: :func:`drain` aborts the communicator, which ends every posted operation.
- :func:`close_group`: a channel's ``close()`` aborts an NCCL group (never waiting on a peer that
  may be dead) instead of dropping it, which would leave the communicator and its watchdog thread
  alive until the process exits.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"
POLL_S = 0.0005
SETTLE_MIN_S = 0.05  # a gloo wait this short still times out for real (and closes the pair) past the deadline
WARM_UP_TAG = (1 << 30) - 1  # sent before any fetch


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """``name=value`` while the body runs (NCCL reads it when a process group is constructed)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def make_group(
    backend: str, store: Any, rank: int, *, timeout: timedelta, device: torch.device, host: str, deadline: float
) -> Any:
    """The pair's process group; for NCCL with its communicator created and one message exchanged by ``deadline``."""
    if backend == "nccl":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        with _env(NCCL_ERROR_HANDLING, CLEAN_UP_ONLY):
            group = dist.ProcessGroupNCCL(store, rank, 2, options)
        warm_up(group, rank, device, deadline)
        return group
    gloo_options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo_options._timeout = timeout  # also bounds every send and receive
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, gloo_options)


def warm_up(group: Any, rank: int, device: torch.device, deadline: float) -> None:
    """One byte from rank 0 to rank 1: creates the NCCL communicator now, bounded by ``deadline``."""
    byte = torch.ones(1, dtype=torch.uint8, device=device)
    work = group.send([byte], 1, WARM_UP_TAG) if rank == 0 else group.recv([byte], 0, WARM_UP_TAG)
    wait_work(work, deadline, "nccl", "the process group's first message")


def wait_work(work: Any, deadline: float, backend: str, what: str = "an answer") -> None:
    """Wait for ``work`` until ``deadline`` (monotonic); TimeoutError past it, RuntimeError if it failed.

    NCCL: polls on the host, then orders the current CUDA stream after the operation."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"no {what} within KVDI_P2P__TIMEOUT_S")
    if backend != "nccl":
        work.wait(timedelta(seconds=left))
        return
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no {what} within KVDI_P2P__TIMEOUT_S")
        time.sleep(POLL_S)
    try:
        exc = work.exception()
    except Exception as raised:  # the binding may raise the stored error instead of returning it
        exc = raised
    if exc is not None:
        raise RuntimeError(f"the process group failed: {exc}")
    work.wait()  # the current stream now follows the operation (no host wait: it completed)


def settle(works: Sequence[Any], deadline: float, backend: str) -> None:
    """After a failed receive: let nothing of ``works`` (posted receives not waited for yet) land after this returns.

    gloo: wait for each, up to ``deadline`` (at least :data:`SETTLE_MIN_S`), ignoring its failure
    (see the module docstring). NCCL: nothing here; :func:`drain` aborts the group."""
    if backend == "nccl":
        return
    for work in works:
        left = max(deadline - time.monotonic(), SETTLE_MIN_S)
        with contextlib.suppress(Exception):  # it failed or timed out: then it will not land either
            work.wait(timedelta(seconds=left))


def close_group(group: Any, backend: str) -> None:
    """Release the pair's group for good: NCCL's communicator is aborted (never waits on the peer)."""
    if group is not None and backend == "nccl":
        with contextlib.suppress(RuntimeError):
            group.abort()


def drain(group: Any) -> bool:
    """Abort ``group`` so nothing still posted on it lands; True when it was aborted."""
    abort = getattr(group, "abort", None)
    if group is None or not callable(abort):
        return False
    with contextlib.suppress(RuntimeError):
        abort()
    return True


__all__ = ["close_group", "drain", "make_group", "settle", "wait_work", "warm_up"]
