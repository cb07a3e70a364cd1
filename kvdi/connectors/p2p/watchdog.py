"""Bounded waits on blocking calls: the p2p channel runs rendezvous-store calls through a :class:`Watchdog`."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Watchdog:
    """Runs blocking store calls on a daemon thread so the caller waits at most a deadline.

    A TCPStore client waits forever for a server that stopped answering (a frozen peer);
    after a timeout the worker thread may stay stuck, so the channel is never used again.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="kvdi-p2p-watchdog", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the caller
                box.append((False, exc))
            done.set()

    def call(self, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn()`` or TimeoutError after ``timeout_s``; exceptions of ``fn`` are re-raised."""
        box: list[Any] = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        if not done.wait(max(timeout_s, 0.0)):
            raise TimeoutError(f"no answer within {timeout_s:.1f}s")
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]


__all__ = ["Watchdog"]
