"""LLMEngine: the generate loop (schedule, execute, sample greedily, update) over a scheduler and a worker."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvdi.connectors.base import ConnectorStats
from kvdi.engine.scheduler import Request, Scheduler, StepResult
from kvdi.engine.worker import Worker

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.001


@dataclass(frozen=True)
class RequestOutput:
    """The result of one prompt.

    ``first_token_logits`` is the float32 logits row the first generated token was chosen
    from (None if the request failed before). ``num_loaded_tokens`` prompt tokens came from
    the connector, ``num_computed_prompt_tokens`` were computed (recomputed ones included);
    ``time_to_first_token_s`` runs from submission to the first sampled token. ``error`` is
    None on success, else a message saying what failed and what to do.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    first_token_logits: torch.Tensor | None
    num_loaded_tokens: int
    num_computed_prompt_tokens: int
    time_to_first_token_s: float | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class EngineConnectorStats:
    """Counters of both connector halves of one engine; ``total`` sums them."""

    connector: str
    scheduler: ConnectorStats
    worker: ConnectorStats

    @property
    def total(self) -> ConnectorStats:
        return self.scheduler.merge(self.worker)


@dataclass(frozen=True)
class BlockPoolUsage:
    """Occupancy of the KV block pool: ``num_free == num_blocks`` when no request holds blocks."""

    num_blocks: int
    num_free: int

    @property
    def whole(self) -> bool:
        return self.num_free == self.num_blocks


class LLMEngine:
    """Greedy generation over a :class:`Scheduler` and a :class:`Worker` (one step at a time, one thread)."""

    def __init__(self, scheduler: Scheduler, worker: Worker, *, drain_timeout_s: float = 30.0) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.drain_timeout_s = drain_timeout_s
        self._ids = itertools.count()
        self._prefix = scheduler.settings.engine_id[:8]
        self._first: dict[str, tuple[torch.Tensor, float]] = {}
        self._closed = False
        self._steps_with_work = 0

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, cache_salt: str | None = None
    ) -> list[RequestOutput]:
        """Greedily generate ``max_new_tokens`` for each prompt; outputs come back in prompt order.

        A request that cannot run (too long, bad token ids, failed load under policy
        ``fail``) comes back with ``error`` set; the others are unaffected.
        """
        requests = [
            self.scheduler.add_request(
                Request(f"{self._prefix}-{next(self._ids)}", tuple(int(t) for t in p), max_new_tokens, cache_salt)
            )
            for p in prompts
        ]
        self._run_until(self.scheduler.has_unfinished)
        self._run_until(self.scheduler.has_pending_frees)
        outputs = [self._output(r) for r in requests]
        self.scheduler.pop_finished(r.request_id for r in requests)
        return outputs

    def step(self) -> list[Request]:
        """Run one schedule / execute / sample / update cycle; returns the requests it finished."""
        plan = self.scheduler.schedule()
        scheduled = [s.request.request_id for s in plan.output.scheduled]
        if scheduled:
            self._steps_with_work += 1
        try:
            out = self.worker.execute(plan)
        except Exception as exc:  # a broken step fails its requests, never the whole batch or the pool
            logger.exception("step %d failed", plan.output.step)
            return self.scheduler.fail_requests(scheduled, f"step failed: {type(exc).__name__}: {exc}")
        sampled: dict[str, int] = {}
        now = time.perf_counter()
        for rid in plan.sample_ids:
            row = out.logits.get(rid)
            if row is None:
                continue
            sampled[rid] = int(torch.argmax(row))
            if rid not in self._first:
                self._first[rid] = (row, now)
        result = StepResult(
            sampled, out.recomputed_tokens, out.failed, out.failed_block_ids, out.finished_sending, out.finished_recving
        )
        return self.scheduler.update(plan, result)

    def _run_until(self, busy: Callable[[], bool]) -> None:
        """Step while ``busy()``; when no step makes progress for ``drain_timeout_s``, stop waiting on the connector.

        Giving up frees blocks held for unfinished sends and fails requests whose
        asynchronous loads never finished, so neither a connector nor a request can hang
        the engine or leak blocks.
        """
        idle_since: float | None = None
        while busy():
            scheduled_before = self._steps_with_work
            finished = self.step()
            if finished or self._steps_with_work != scheduled_before:
                idle_since = None
                continue
            now = time.perf_counter()
            if idle_since is None:
                idle_since = now
            elif now - idle_since > self.drain_timeout_s:
                logger.warning("connector made no progress in %.1fs; giving up on it", self.drain_timeout_s)
                self.scheduler.release_delayed()
                self.scheduler.fail_waiting_for_remote(
                    f"the KV connector did not finish loading within {self.drain_timeout_s:.1f}s"
                )
                idle_since = None
            time.sleep(IDLE_POLL_S)

    def _output(self, req: Request) -> RequestOutput:
        first = self._first.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=tuple(req.output_token_ids),
            first_token_logits=None if first is None else first[0],
            num_loaded_tokens=req.num_loaded_tokens,
            num_computed_prompt_tokens=req.num_computed_prompt_tokens,
            time_to_first_token_s=None if first is None else first[1] - req.arrival_time,
            error=req.error,
        )

    def connector_stats(self) -> EngineConnectorStats:
        """Counters of the scheduler half and the worker half (``.total`` merges them)."""
        return EngineConnectorStats(
            self.scheduler.connector.name, self.scheduler.connector.stats, self.worker.connector.stats
        )

    @property
    def block_pool(self) -> BlockPoolUsage:
        """How many KV blocks exist and how many are free right now."""
        pool = self.scheduler.pool
        return BlockPoolUsage(pool.num_blocks, pool.num_free)

    def shutdown(self) -> None:
        """Call both connector halves' ``shutdown`` once; the container frees the cache and backend."""
        if self._closed:
            return
        self._closed = True
        self.scheduler.connector.shutdown()
        self.worker.connector.shutdown()
