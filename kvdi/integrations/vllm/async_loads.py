"""Asynchronous loads as vLLM's scheduler sees them: which half reports a request's end, and how (vLLM-free).

vLLM parks a request whose load is asynchronous in ``WAITING_FOR_REMOTE_KVS`` and resumes it
when the workers report it in ``finished_recving``. If vLLM finishes such a request while it
still waits (aborted, or failed by ``kv_load_failure_policy="fail"``), vLLM holds its blocks
itself and frees them on the ``finished_recving`` report; a ``finished_sending`` report for it
afterwards (or a held free from the connector on top) trips vLLM's bookkeeping. kvdi's worker
half holds every request with an asynchronous transfer and reports it finished sending when
it ends, so the adapter reconciles the two:

- scheduler role (:class:`SchedulerLoads`): a request finished before vLLM resumed it is not
  held by kvdi (``delay_free=False``) and its id goes to the workers in the next metadata
  (``unheld``);
- worker role (:class:`WorkerLoads`): for an ``unheld`` request the worker's later
  finished-sending report is dropped when it was already reported finished receiving, and
  becomes the finished-receiving report otherwise (its load was still running when it ended).

The worker role also counts, per load, the engine steps it spanned: 1 when it was reported
finished receiving in the step whose metadata started it (vLLM schedules it in the next
step), 2 when one step later, and so on (``load_steps_*`` in :class:`AdapterStats`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvdi.integrations.vllm.fleet.stats import AdapterStats


class SchedulerLoads:
    """Scheduler role: requests offered or parked for an asynchronous load, and those finished while parked."""

    def __init__(self) -> None:
        self.offered: set[str] = set()
        self.parked: set[str] = set()
        self.unheld: list[str] = []  # finished while parked, for the workers in the next metadata

    def offer(self, request_id: str, load_async: bool) -> None:
        """The lookup answered ``load_async`` for a non-empty hit (or not)."""
        if load_async:
            self.offered.add(request_id)
        else:
            self.offered.discard(request_id)

    def allocated(self, request_id: str, num_external_tokens: int) -> bool:
        """vLLM allocated the request's blocks; True when, with external tokens of an async offer, it now
        waits in ``WAITING_FOR_REMOTE_KVS``."""
        parked = request_id in self.offered and num_external_tokens > 0
        if parked:
            self.parked.add(request_id)
        self.offered.discard(request_id)
        return parked

    def scheduled(self, request_ids: Iterable[str]) -> None:
        """Requests vLLM scheduled this step: a parked one was resumed, its load is done."""
        for rid in request_ids:
            self.parked.discard(rid)

    def finished(self, request_id: str, delay_free: bool) -> bool:
        """The ``delay_free`` to answer for a finished request (False when it ended while parked)."""
        self.offered.discard(request_id)
        if request_id not in self.parked:
            return delay_free
        self.parked.discard(request_id)
        self.unheld.append(request_id)
        return False

    def take_unheld(self) -> tuple[str, ...]:
        """Ids finished while parked since the last call, for the workers."""
        out, self.unheld = tuple(self.unheld), []
        return out


class WorkerLoads:
    """Worker role: asynchronous loads in flight (block id -> key, for a block index) and the end reports."""

    def __init__(self, counts: AdapterStats | None = None, idle_wait_s: float = 0.0) -> None:
        self.counts = counts if counts is not None else AdapterStats()
        self.idle_wait_s = idle_wait_s  # transfer.idle_load_wait_ms, in seconds (:func:`.pending.wait_for_loads`)
        self.step = 0  # engine steps seen (one metadata bound per step)
        self.idle = False  # this step schedules no tokens (vLLM only runs the connector hooks)
        self._since: dict[str, int] = {}  # request -> step its load started in
        self.loading: dict[str, dict[int, bytes]] = {}
        self.loaded: dict[str, dict[int, bytes]] = {}  # reported this step: their load errors come next
        self._received: set[str] = set()  # reported finished receiving, not yet finished
        self.unheld_ids: set[str] = set()  # finished while parked, their end still to be reported

    def next_step(self, idle: bool) -> None:
        """A new engine step bound its metadata; ``idle`` when it schedules no tokens."""
        self.step += 1
        self.idle = idle

    def started(self, request_id: str, block_ids: Iterable[int], block_keys: Iterable[bytes]) -> None:
        self.loading[request_id] = dict(zip(block_ids, block_keys, strict=True))
        self._since[request_id] = self.step

    def _spanned(self, request_id: str) -> None:
        since = self._since.pop(request_id, None)
        if since is None:
            return
        steps = self.step - since + 1
        c = self.counts
        c.async_load_steps += steps
        if steps == 1:
            c.load_steps_1 += 1
        elif steps == 2:
            c.load_steps_2 += 1
        elif steps == 3:
            c.load_steps_3 += 1
        else:
            c.load_steps_4_or_more += 1

    def unheld(self, request_ids: Iterable[str]) -> None:
        self.unheld_ids.update(request_ids)

    def reconcile(self, sending: set[str] | None, recving: set[str] | None) -> tuple[set[str], set[str]]:
        """The worker half's (finished sending, finished receiving) as vLLM must see them."""
        send, recv = set(sending or ()), set(recving or ())
        for rid in recv:
            self._received.add(rid)
        for rid in send & self.unheld_ids:
            send.discard(rid)
            self.unheld_ids.discard(rid)
            if rid in self._received:
                self._received.discard(rid)  # vLLM freed it on that report
            else:
                recv.add(rid)  # its load ended after vLLM finished it: this is the report vLLM waits for
        self._received -= send
        for rid in recv:
            self._spanned(rid)
        for rid in send | recv:
            if rid in self.loading:
                self.loaded[rid] = self.loading.pop(rid)
        self.counts.finished_sending += len(send)
        self.counts.finished_recving += len(recv)
        return send, recv

    def block_keys(self) -> dict[int, bytes]:
        """Block id -> key of every asynchronous load in flight or reported this step."""
        keys: dict[int, bytes] = {}
        for blocks in (*self.loading.values(), *self.loaded.values()):
            keys.update(blocks)
        return keys
