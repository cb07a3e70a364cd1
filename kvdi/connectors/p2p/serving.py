"""The producer's serving loop: answers the consumer's fetches from the held blocks.

One daemon thread pops the request queue of the rendezvous store (polling: a blocking pop
logs a C++ warning per timeout), answers each request over the process group (a header of
found flags and frame headers, then each layer of the found blocks in parts of a few MiB; over
NCCL each part is copied to the device first, and at most ``wire_budget`` bytes of such copies
(the producer's ``allocator.max_staging_bytes``, at least one part) are in flight at once: the
server waits for those sends on the host before it copies more, whatever the consumer asked for),
frees blocks on the consumer's acknowledgement, and unpublishes blocks that expire. Every
message is decoded strictly (:meth:`~kvdi.connectors.p2p.protocol.Session.decode`): a bad one
is dropped, counted in :attr:`Server.rejected` and logged once per reason, and the loop goes
on. Would-be consumers that queue a hello after the pairing are answered ``busy``. Only a
failure to reach the consumer or the store ends it (``on_break`` is called).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kvdi.connectors.logging_once import log_once
from kvdi.connectors.p2p.groups import wait_work
from kvdi.connectors.p2p.held import HeldBlocks
from kvdi.connectors.p2p.pairing import answer_busy
from kvdi.connectors.p2p.protocol import CONSUMER_RANK, REQUEST_QUEUE, Ack, BadMessage, Request, Session, tag
from kvdi.connectors.store.framing import HEADER_SIZE

if TYPE_CHECKING:  # torch.distributed re-exports it at run time only
    from torch._C._distributed_c10d import Store

logger = logging.getLogger(__name__)

# Poll every POLL_HOT_S for HOT_S after a message (a consumer fetches once per engine step),
# backing off to POLL_MAX_S when idle.
POLL_HOT_S = 0.0002
HOT_S = 0.05
POLL_MAX_S = 0.002
SWEEP_S = 0.1


class Server:
    """The serving thread of one producer channel; :meth:`start` once, :meth:`stop` to end it."""

    def __init__(
        self,
        store: Store,
        group: Any,
        held: HeldBlocks,
        session: Session,
        *,
        layer_bytes: int,
        parts: Callable[[int], list[tuple[int, int, int]]],
        wire: Callable[[torch.Tensor], torch.Tensor],
        timeout_s: float,
        hold_s: float,
        on_break: Callable[[str], None],
        backend: str = "gloo",
        wire_budget: int | None = None,
    ) -> None:
        """``wire_budget``: bytes of device copies of parts (``wire``) in flight at once; None: ``wire``
        copies nothing (gloo sends the held host frames themselves)."""
        self._store = store.clone()  # type: ignore[attr-defined]  # its own connection: pops never wait on publishing
        self._group = group
        self.held = held
        self.session = session
        self._layer_bytes = layer_bytes
        self._parts = parts
        self._wire = wire
        self._timeout = timedelta(seconds=timeout_s)
        self._timeout_s = timeout_s
        self._backend = backend
        self._wire_budget = wire_budget
        self._hold_s = hold_s
        self._on_break = on_break
        self._stop = threading.Event()
        self._inflight: dict[int, tuple[list[bytes], float]] = {}
        self._logged: set[str] = set()
        self.rejected = 0  # bad messages dropped
        self.busy_answered = 0  # hellos answered ``busy`` (this producer is paired already)
        self._thread = threading.Thread(target=self._run, name="kvdi-p2p-serve", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop answering; returns once the thread ended or after ``timeout_s``."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        store = self._store
        idle = POLL_HOT_S
        last = time.monotonic()
        next_sweep = 0.0
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_sweep:
                    self.unpublish(store, self.held.expire())
                    self._forget_stale()
                    self.busy_answered += answer_busy(store)  # would-be consumers arriving after the pairing
                    next_sweep = time.monotonic() + SWEEP_S
                try:
                    raw = store.queue_pop(REQUEST_QUEUE, False)
                except dist.QueueEmptyError:
                    self._stop.wait(idle)
                    if time.monotonic() - last > HOT_S:
                        idle = min(idle * 2, POLL_MAX_S)
                    continue
                idle, last = POLL_HOT_S, time.monotonic()
                self._handle(store, raw)
        except (RuntimeError, ValueError, TimeoutError) as exc:  # the consumer or the store is gone
            self._on_break(f"serving failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            with contextlib.suppress(RuntimeError):  # offer nothing a broken channel cannot send
                self.unpublish(store, self.held.clear())

    def _handle(self, store: Store, raw: object) -> None:
        try:
            message = self.session.decode(raw)
        except BadMessage as exc:
            self.rejected += 1
            log_once(logger, self._logged, exc.reason, "p2p producer dropped a bad request message: %s", exc)
            return
        if isinstance(message, Ack):
            keys, _ = self._inflight.pop(message.seq, ([], 0.0))
            self.unpublish(store, self.held.release(keys))
        else:
            self._answer(message)

    def _answer(self, request: Request) -> None:
        seq, names = request.seq, request.names
        found, frames = self.held.lookup(names)
        n = len(names)
        header = torch.zeros(8 + n * (1 + HEADER_SIZE), dtype=torch.uint8)
        header[:8].view(torch.int64)[0] = self._layer_bytes
        header[8 : 8 + n] = torch.tensor(found, dtype=torch.uint8)
        works = []
        if frames is not None:
            header[8 + n : 8 + n + frames.headers.numel()] = frames.headers
        deadline = time.monotonic() + self._timeout_s
        works.append(self._group.send([self._wire(header)], CONSUMER_RANK, tag(seq, 0)))
        if frames is not None:
            lb, copied = self._layer_bytes, 0
            for part, (layer, a, b) in enumerate(self._parts(frames.count), start=1):
                src = frames.layers[layer, a * lb : b * lb]
                if self._wire_budget is not None:  # device copies: bounded, whatever the consumer asked for
                    if copied and copied + src.numel() > self._wire_budget:
                        self._settle(works, deadline)
                        works, copied = [], 0
                    copied += src.numel()
                works.append(self._group.send([self._wire(src)], CONSUMER_RANK, tag(seq, part)))
        self._settle(works, deadline)
        self._inflight[seq] = ([k for k, f in zip(names, found, strict=True) if f], time.monotonic())

    def _settle(self, works: Sequence[Any], deadline: float) -> None:
        """Wait on the host until ``works`` (sends) are done; their device copies may then be freed."""
        for work in works:
            wait_work(work, deadline, self._backend, "a send")

    def _forget_stale(self) -> None:
        """Drop sent batches never acknowledged (their blocks expire on their own)."""
        limit = time.monotonic() - self._hold_s
        for seq in [s for s, (_, t) in self._inflight.items() if t < limit]:
            del self._inflight[seq]

    def unpublish(self, store: Store, names: Sequence[bytes]) -> None:
        for name in names:
            store.delete_key(self.session.published(name))


__all__ = ["Server"]
