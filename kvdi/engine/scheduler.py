"""FCFS scheduler with a block manager; drives the scheduler half of a KV connector.

The scheduler never touches device memory: it hands out block ids, decides how many tokens
each request computes per step, and tells the connector what happened. A request reserves
every block it will ever need when it is admitted (prompt plus new tokens), so admitted
requests never stall for blocks and there is no preemption.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvdi.allocator import AllocationPlan
from kvdi.connectors.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    KVRequest,
    ScheduledRequest,
    SchedulerConnector,
    SchedulerOutput,
    loadable_tokens,
    require_role,
)
from kvdi.errors import KVLoadError
from kvdi.settings import KvdiSettings

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Mutable state of one request; the engine reads it once the request is finished."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_loaded_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    error: str | None = None

    @property
    def kv_request(self) -> KVRequest:
        return KVRequest(self.request_id, self.prompt_token_ids, self.cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """Token ids at positions ``[start, end)`` (prompt, then generated)."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + tuple(self.output_token_ids))[start:end]


class BlockPool:
    """Free list of KV block ids ``0 .. num_blocks-1``; a block is either free or held by one request."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._free_set = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks; raises ValueError if fewer are free (check :attr:`num_free` first)."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        taken = [self._free.popleft() for _ in range(n)]
        self._free_set.difference_update(taken)
        return taken

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool; raises ValueError on a block that is already free."""
        for block in block_ids:
            if block in self._free_set or not 0 <= block < self.num_blocks:
                raise ValueError(f"block {block} is already free or out of range")
            self._free.append(block)
            self._free_set.add(block)


@dataclass(frozen=True)
class StepPlan:
    """One step: what connectors see (``output``, ``metadata``) plus what the worker needs to compute.

    ``new_token_ids[rid]`` are the tokens of that request's chunk; ``sample_ids`` are the
    requests whose chunk ends at their last known token, so a token is sampled for them.
    """

    output: SchedulerOutput
    metadata: KVConnectorMetadata
    new_token_ids: Mapping[str, tuple[int, ...]]
    sample_ids: frozenset[str]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.output.scheduled)


@dataclass(frozen=True)
class StepResult:
    """What the engine reports back after the worker ran a step."""

    sampled: Mapping[str, int] = field(default_factory=dict)
    recomputed_tokens: Mapping[str, int] = field(default_factory=dict)
    failed: Mapping[str, str] = field(default_factory=dict)
    failed_block_ids: frozenset[int] = frozenset()
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()


class Scheduler:
    """First come, first served under ``max_num_batched_tokens`` and ``max_num_seqs``, with chunked prefill."""

    def __init__(self, connector: SchedulerConnector, plan: AllocationPlan, settings: KvdiSettings) -> None:
        require_role(connector, KVConnectorRole.SCHEDULER, "Scheduler")
        self.connector = connector
        self.settings = settings
        self.block_size = settings.allocator.block_size
        self.pool = BlockPool(plan.num_blocks)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._remote: dict[str, Request] = {}
        self._requests: dict[str, Request] = {}
        self._delayed_free: dict[str, list[int]] = {}
        self._finished_since_step: set[str] = set()
        self._step = 0

    # -- requests -----------------------------------------------------------------
    def add_request(self, request: Request) -> Request:
        """Queue a request; one that can never run is finished at once with ``error`` set."""
        problem = self._cannot_fit(request)
        self._requests[request.request_id] = request
        if problem is not None:
            self._finish(request, error=f"request {request.request_id}: {problem}")
        else:
            self._waiting.append(request)
        return request

    def blocks_needed(self, request: Request) -> int:
        """Blocks to hold every token whose KV is ever written (the last generated token's is not)."""
        tokens = len(request.prompt_token_ids) + request.max_new_tokens - 1
        return -(-tokens // self.block_size)

    def _cannot_fit(self, request: Request) -> str | None:
        m = self.settings.model
        n = len(request.prompt_token_ids)
        if n == 0:
            return "the prompt is empty"
        if request.max_new_tokens < 1:
            return f"max_new_tokens must be >= 1, got {request.max_new_tokens}"
        bad = [t for t in request.prompt_token_ids if not 0 <= t < m.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {m.vocab_size}) (model.vocab_size)"
        if n + request.max_new_tokens > m.max_model_len:
            return (
                f"prompt ({n} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds "
                f"model.max_model_len={m.max_model_len} (KVDI_MODEL__MAX_MODEL_LEN)"
            )
        need = self.blocks_needed(request)
        if need > self.pool.num_blocks:
            return (
                f"needs {need} KV blocks of {self.block_size} tokens but the cache has only "
                f"{self.pool.num_blocks}; raise KVDI_ALLOCATOR__NUM_BLOCKS or shorten the prompt"
            )
        return None

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self._waiting or self._running or self._remote)

    def has_pending_frees(self) -> bool:
        """True while finished requests' blocks wait for the worker connector (``delay_free``)."""
        return bool(self._delayed_free)

    def pop_finished(self, request_ids: Iterable[str]) -> list[Request]:
        """Forget finished requests and return them (the engine's last look)."""
        return [self._requests.pop(rid) for rid in request_ids]

    # -- one step -----------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Decide this step's chunks, admit waiting requests that fit, and build the connector metadata."""
        budget = self.settings.scheduler.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        new_tokens: dict[str, tuple[int, ...]] = {}
        samples: set[str] = set()

        def add(req: Request, n: int) -> None:
            start = req.num_computed_tokens
            scheduled.append(ScheduledRequest(req.kv_request, tuple(req.block_ids), start, n))
            new_tokens[req.request_id] = req.token_ids(start, start + n)
            if start + n == req.num_tokens:
                samples.add(req.request_id)

        for req in self._running:
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            add(req, n)
            budget -= n
        while (
            self._waiting
            and budget > 0
            and len(self._running) + len(self._remote) < self.settings.scheduler.max_num_seqs
        ):
            req = self._waiting[0]
            if self.blocks_needed(req) > self.pool.num_free:
                break  # FCFS: later requests wait behind this one until blocks come back
            self._waiting.popleft()
            if self._admit(req):
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                add(req, n)
                budget -= n
        self._step += 1
        output = SchedulerOutput(self._step, tuple(scheduled), frozenset(self._finished_since_step))
        self._finished_since_step = set()
        try:
            metadata = self.connector.build_connector_meta(output)
        except Exception as exc:  # the step's requests fail; their blocks come back
            logger.exception("connector %r: build_connector_meta failed", self.connector.name)
            message = f"connector {self.connector.name!r} failed to plan the step: {type(exc).__name__}: {exc}"
            self.fail_requests(new_tokens, message)
            output = SchedulerOutput(self._step, (), output.finished_req_ids)
            return StepPlan(output, KVConnectorMetadata(), {}, frozenset())
        return StepPlan(output, metadata, new_tokens, frozenset(samples))

    def _admit(self, req: Request) -> bool:
        """Ask the connector, allocate blocks; True if the request computes this step."""
        name = self.connector.name
        try:
            matched, load_async = self.connector.get_num_new_matched_tokens(req.kv_request, 0)
        except Exception:  # a lookup that fails is a miss: the request computes its prompt
            logger.exception("connector %r: get_num_new_matched_tokens(%s) failed; computing", name, req.request_id)
            matched, load_async = 0, False
        if matched is None:  # "ask again" needs a host that asks again (vLLM); this engine never enables it
            matched, load_async = 0, False
        limit = loadable_tokens(len(req.prompt_token_ids), self.block_size)
        external = max(0, min(matched, limit)) // self.block_size * self.block_size
        req.block_ids = self.pool.allocate(self.blocks_needed(req))
        try:
            self.connector.update_state_after_alloc(req.kv_request, req.block_ids, external)
        except Exception as exc:
            logger.exception("connector %r: update_state_after_alloc(%s) failed", name, req.request_id)
            self._finish(req, error=f"request {req.request_id}: connector {name!r} failed: {type(exc).__name__}: {exc}")
            return False
        req.num_computed_tokens = req.num_loaded_tokens = external
        if load_async and external:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self._remote[req.request_id] = req
            return False
        req.status = RequestStatus.RUNNING
        self._running.append(req)
        return True

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply a step's results; returns the requests that finished in this step."""
        done: list[Request] = []
        for rid, message in result.failed.items():
            done.append(self._finish(self._requests[rid], error=message))
        for sched in plan.output.scheduled:
            req = self._requests.get(sched.request.request_id)
            if req is None or req.finished:
                continue
            recomputed = result.recomputed_tokens.get(req.request_id, 0)
            req.num_loaded_tokens -= recomputed
            start, end = sched.num_computed_tokens, sched.num_computed_tokens + sched.num_scheduled_tokens
            req.num_computed_prompt_tokens += recomputed + max(0, min(end, len(req.prompt_token_ids)) - start)
            req.num_computed_tokens = end
            token = result.sampled.get(req.request_id)
            if token is not None:
                req.output_token_ids.append(token)
                if len(req.output_token_ids) >= req.max_new_tokens:
                    done.append(self._finish(req))
        done.extend(self._resolve_remote(result))
        for rid in result.finished_sending:
            blocks = self._delayed_free.pop(rid, None)
            if blocks is not None:
                self.pool.free(blocks)
        return done

    def _resolve_remote(self, result: StepResult) -> list[Request]:
        """Async loads: failed blocks per policy, finished loads become runnable."""
        done = []
        for rid, req in list(self._remote.items()):
            bad = [
                i
                for i, b in enumerate(req.block_ids)
                if b in result.failed_block_ids and i * self.block_size < req.num_computed_tokens
            ]
            if bad and self.settings.kv_load_failure_policy == "fail":
                done.append(self._finish(req, error=load_error_message(rid, [req.block_ids[i] for i in bad])))
                continue
            if bad:
                req.num_loaded_tokens = req.num_computed_tokens = min(bad) * self.block_size
            if bad or rid in result.finished_recving:
                del self._remote[rid]
                req.status = RequestStatus.RUNNING
                self._running.append(req)
        return done

    def fail_requests(self, request_ids: Iterable[str], message: str) -> list[Request]:
        """Finish the given unfinished requests with ``error=message`` and free their blocks."""
        reqs = [self._requests[rid] for rid in request_ids if rid in self._requests]
        return [self._finish(r, error=message) for r in reqs if not r.finished]

    def fail_waiting_for_remote(self, message: str) -> list[Request]:
        """Finish every request still waiting for an asynchronous load with ``error=message``."""
        return [self._finish(req, error=f"request {rid}: {message}") for rid, req in list(self._remote.items())]

    def release_delayed(self) -> None:
        """Free blocks still held for the connector (used when the engine gives up waiting)."""
        for blocks in self._delayed_free.values():
            self.pool.free(blocks)
        self._delayed_free.clear()

    def _finish(self, req: Request, error: str | None = None) -> Request:
        if req.finished:
            return req
        if req.status is RequestStatus.WAITING and req in self._waiting:
            self._waiting.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        elif req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._remote.pop(req.request_id, None)
        admitted = bool(req.block_ids)
        req.status, req.error = RequestStatus.FINISHED, error
        if not admitted:
            return req
        blocks, req.block_ids = req.block_ids, []
        delay = False
        try:
            delay, _params = self.connector.request_finished(req.kv_request, blocks)
        except Exception:  # the blocks must come back whatever the connector does
            logger.exception(
                "connector %r request_finished(%s) raised; freeing its blocks", self.connector.name, req.request_id
            )
        if delay:
            self._delayed_free[req.request_id] = blocks
        else:
            self.pool.free(blocks)
        self._finished_since_step.add(req.request_id)
        return req


def load_error_message(request_id: str, block_ids: Iterable[int]) -> str:
    """The text of a :class:`KVLoadError` for a request whose KV blocks failed to load."""
    return str(
        KVLoadError(
            f"request {request_id}: loading KV blocks {sorted(block_ids)} from the connector failed and "
            "kv_load_failure_policy=fail; set kv_load_failure_policy=recompute (KVDI_KV_LOAD_FAILURE_POLICY=recompute) "
            "to recompute them instead"
        )
    )
