"""Rendezvous helpers of the p2p channel: bounded waits on store calls, and the handshake check.

A TCPStore client waits forever for a server that stopped answering (a frozen peer), so
the channel runs such calls through a :class:`Watchdog`. :func:`handshake_problems` says
why two peers' hello messages do not make a pair (empty when they do).
"""

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


def describe_layout(layout: dict[str, Any]) -> str:
    """One line naming every field of a layout, as both sides of a handshake print it."""
    return ", ".join(f"{k}={v}" for k, v in layout.items())


def handshake_problems(mine: dict[str, Any], peer: dict[str, Any], backend: str) -> list[str]:
    """What keeps two hello messages (role, backend, layout, fingerprint) from making a pair."""
    problems: list[str] = []
    if peer.get("fingerprint") != mine["fingerprint"]:
        problems.append(
            f"foreign KV layout: this {mine['role']} has [{describe_layout(mine['layout'])}], "
            f"the {peer.get('role')} has [{describe_layout(peer.get('layout', {}))}]; "
            "both sides need the same model, dtype, layers, heads, head_dim and block_size"
        )
    if peer.get("backend") != backend:
        problems.append(
            f"backend differs: this side uses {backend}, the peer {peer.get('backend')} (KVDI_P2P__BACKEND)"
        )
    if peer.get("role") == mine["role"]:
        problems.append(
            f"both sides are {mine['role']}; one must be kv_producer (rank 0), the other kv_consumer (rank 1)"
        )
    return problems


__all__ = ["Watchdog", "describe_layout", "handshake_problems"]
