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
- :func:`drain`: after a failed fetch the group is aborted, so receives still posted (into
  the KV cache, or into staging) cannot land late in blocks that may belong to another request.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"
POLL_S = 0.0005
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


def drain(group: Any) -> bool:
    """Abort ``group`` so nothing still posted on it lands; True when it was aborted."""
    abort = getattr(group, "abort", None)
    if group is None or not callable(abort):
        return False
    with contextlib.suppress(RuntimeError):
        abort()
    return True


__all__ = ["drain", "make_group", "wait_work", "warm_up"]
