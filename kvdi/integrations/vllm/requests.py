"""vLLM requests and scheduler output as kvdi's :class:`KVRequest` and :class:`SchedulerOutput`.

vLLM objects arrive here as attribute bags (typed ``Any``: vLLM's ``Request``,
``SchedulerOutput``, ``NewRequestData``, ``CachedRequestData``); this module never imports vLLM.
"""

from __future__ import annotations

from typing import Any

from kvdi.connectors.base import KVRequest, ScheduledRequest, SchedulerOutput
from kvdi.connectors.store.keys import compose_salt

_NO_IDS: frozenset[str] = frozenset()
QUIET = SchedulerOutput(0, (), _NO_IDS)  # a quiet step's output (its step number aside), as the null half sees it


def kv_request(request: Any) -> KVRequest:
    """kvdi's view of a vLLM ``Request``: id, prompt tokens, and a salt covering cache salt, LoRA and images.

    Each part of the salt is tagged and length-prefixed, so requests differing in any of
    them never share KV. Requests with prompt embeddings instead of token ids get no
    tokens (never cached).
    """
    return KVRequest(str(request.request_id), token_ids(getattr(request, "prompt_token_ids", None)), kv_salt(request))


def kv_salt(request: Any) -> str | None:
    """The salt :func:`kv_request` gives ``request`` (cache salt, LoRA, images), without its tokens."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    lora_name = None if lora is None else str(getattr(lora, "lora_name", lora))
    mm = [str(getattr(f, "identifier", f)) for f in getattr(request, "mm_features", None) or ()]
    return compose_salt(None if salt is None else str(salt), lora_name, mm)


def token_ids(tokens: Any) -> tuple[int, ...]:
    """Prompt token ids as a tuple of ints: vLLM's list of ints copied as it is (about 1 µs for 800 tokens, where a
    conversion token by token took 50 µs of every lookup); anything else (numpy integers, an array) converted."""
    if tokens is None:
        return ()
    if type(tokens) is list and (not tokens or (type(tokens[0]) is int and type(tokens[-1]) is int)):
        return tuple(tokens)
    return tuple(map(int, tokens))


class RequestTracker:
    """What the scheduler half remembers per running request to rebuild kvdi's full :class:`ScheduledRequest`.

    One :class:`KVRequest` per request id, built on first sight and reused until the
    request finishes; each request's block lists as vLLM grows them (vLLM sends only new
    blocks of running requests), one per KV cache group (:attr:`groups`; :attr:`blocks` is
    the first group's), with the first group's tuple rebuilt only when it changed.

    With :attr:`prompt_only` (kvdi's own halves, which load and save prompt blocks only: see
    :func:`~.scheduler_side.prompt_steps_only`) a step passes on only the requests that can still move a block:
    new and resumed ones, and running ones whose prompt is not computed yet. A request whose
    prompt the step computes to its end is passed on that step, then settles: its block lists
    are dropped and later steps skip it without looking at it (decoding requests cost nothing
    per step) until vLLM resumes it with its full block lists after a preemption.
    """

    def __init__(self, prompt_only: bool = False) -> None:
        self.requests: dict[str, KVRequest] = {}
        self.blocks: dict[str, list[int]] = {}
        self.groups: dict[str, list[list[int]]] = {}
        self._block_tuples: dict[str, tuple[int, ...]] = {}
        self.step = 0
        self.prompt_only = prompt_only
        self.in_prompt: set[str] = set()  # prompt_only: running requests whose prompt is not computed yet
        self._settled: list[str] = []  # prompt_only: passed on for the last time last step: block lists to drop

    def request(self, vllm_request: Any) -> KVRequest:
        """The :class:`KVRequest` of ``vllm_request``, built once per request id."""
        rid = str(vllm_request.request_id)
        request = self.requests.get(rid)
        if request is None:
            request = self.requests[rid] = kv_request(vllm_request)
        return request

    def remember(self, request: KVRequest) -> None:
        self.requests[request.request_id] = request

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.in_prompt.discard(request_id)
        self._drop_blocks(request_id)

    def _drop_blocks(self, request_id: str) -> None:
        self.blocks.pop(request_id, None)
        self.groups.pop(request_id, None)
        self._block_tuples.pop(request_id, None)

    def _set_blocks(self, req_id: str, groups: Any) -> None:
        lists = [list(g) for g in groups or ()] or [[]]
        self.groups[req_id] = lists
        self.blocks[req_id] = lists[0]
        self._block_tuples.pop(req_id, None)

    def _add_blocks(self, req_id: str, groups: Any) -> None:
        have = self.groups.get(req_id)
        if have is None:
            self._set_blocks(req_id, groups)
            return
        for mine, new in zip(have, groups, strict=False):
            mine.extend(new)
        self._block_tuples.pop(req_id, None)

    def quiet(self, output: Any) -> bool:
        """With :attr:`prompt_only`: whether vLLM's step ``output`` passes no request on (every scheduled request
        decodes: none new, resumed, finished or in its prompt), decided without looking at any request. Such a
        step is counted here (:attr:`step`) and must not be translated; :data:`QUIET` is kvdi's output of it."""
        if (
            self.prompt_only
            and not self._settled
            and not output.scheduled_new_reqs
            and not output.scheduled_cached_reqs.resumed_req_ids
            and not output.finished_req_ids
            and not (self.in_prompt and self._in_prompt_scheduled(output.num_scheduled_tokens))
        ):
            self.step += 1
            return True
        return False

    def translate(self, output: Any) -> SchedulerOutput:
        """kvdi's SchedulerOutput of one vLLM step; updates block lists (new requests, growth, resumption)."""
        if self.quiet(output):
            return SchedulerOutput(self.step, (), _NO_IDS)
        return self.translate_busy(output)

    def translate_busy(self, output: Any) -> SchedulerOutput:
        """:meth:`translate` of a step that is not :meth:`quiet` (asked already)."""
        cached = output.scheduled_cached_reqs
        for req_id in self._settled:  # the half planned their last step: their block lists are of no more use
            if req_id not in self.in_prompt:
                self._drop_blocks(req_id)
        self._settled = []
        scheduled: list[ScheduledRequest] = []
        # Which of vLLM's scheduled cached requests to look at, by their index in its lists (before new ones join).
        picked = self._picked(cached, output.num_scheduled_tokens) if self.prompt_only else range(len(cached.req_ids))
        for new in output.scheduled_new_reqs:
            req_id = str(new.req_id)
            request = self.requests.get(req_id)
            if request is None:
                request = KVRequest(req_id, tuple(new.prompt_token_ids or ()))
                self.requests[req_id] = request
            self._set_blocks(req_id, new.block_ids)
            scheduled.append(self._scheduled(request, new.num_computed_tokens, output))
        for i in picked:
            req_id = cached.req_ids[i]
            request = self.requests.get(req_id)
            if request is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._set_blocks(req_id, new_blocks)
            elif new_blocks and any(new_blocks):
                self._add_blocks(req_id, new_blocks)
            scheduled.append(self._scheduled(request, cached.num_computed_tokens[i], output))
        finished = frozenset(str(r) for r in output.finished_req_ids)
        for req_id in finished:
            self.forget(req_id)
        self.step += 1
        return SchedulerOutput(self.step, tuple(scheduled), finished)

    def _in_prompt_scheduled(self, num_scheduled: Any) -> bool:
        return any(r in num_scheduled for r in self.in_prompt)

    def _picked(self, cached: Any, num_scheduled: Any) -> list[int]:
        """prompt_only: indexes in ``cached`` of the resumed requests and those still in their prompt, in vLLM's
        order; no work at all when there are none (every running request decodes)."""
        resumed = cached.resumed_req_ids
        wanted = [r for r in self.in_prompt if r in num_scheduled]
        if not wanted and not resumed:
            return []
        ids = cached.req_ids
        if len(wanted) + len(resumed) > 4:
            where = {r: i for i, r in enumerate(ids)}
            return sorted(i for i in map(where.get, {*wanted, *resumed}) if i is not None)
        return sorted(ids.index(r) for r in {*wanted, *resumed} if r in ids)

    def _scheduled(self, request: KVRequest, num_computed: int, output: Any) -> ScheduledRequest:
        rid = request.request_id
        blocks = self._block_tuples.get(rid)
        if blocks is None:
            blocks = self._block_tuples[rid] = tuple(self.blocks.get(rid, ()))
        num_scheduled = int(output.num_scheduled_tokens.get(rid, 0))
        if self.prompt_only:  # still in its prompt after this step? Otherwise this is the last step it is passed on
            if int(num_computed) + num_scheduled < len(request.prompt_token_ids):
                self.in_prompt.add(rid)
            else:
                self.in_prompt.discard(rid)
                self._settled.append(rid)
        return ScheduledRequest(request, blocks, int(num_computed), num_scheduled)
