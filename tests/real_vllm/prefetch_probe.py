"""``engine_run.py`` with prefetch at lookup watched from inside (in-process engines only).

Usage: ``python tests/real_vllm/prefetch_probe.py SPEC.json``; the spec is ``engine_run.py``'s plus
``abort`` (indices of prompts, each aborted once its prefetch is running), and the result gains
``probes``:

- ``max_staged_bytes``: the most host staging kvdi's worker held after any engine step;
- ``aborted_while_staging``: the aborted requests that held staging when they were aborted;
- ``staged_bytes_at_end`` / ``staged_requests_at_end`` / ``reserved_at_end``: the worker's staging
  and the scheduler's reservation once the engine drained (both must be empty);
- ``fallbacks``, ``refused``: hits that took the plain path past the scheduler's bound, and
  prefetches the worker refused (past its own bound);
- ``preempted``: vLLM's preemptions (none expected).

Each round adds the prompts to vLLM's engine and steps it by hand; an aborted request's output is
``[]`` with finish reason ``abort``.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import engine_run  # type: ignore[import-not-found,unused-ignore]
    import vllm
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.entrypoints.llm import LLM

    probes: dict[str, Any] = {"max_staged_bytes": 0, "aborted_while_staging": []}

    class ProbedLLM(LLM):  # type: ignore[misc,unused-ignore]
        """vLLM's LLM whose generate() steps the engine by hand, sampling kvdi's staging after each step, then
        drains it and reads kvdi's staging and reservation."""

        def generate(self, prompts: Any, params: Any, **kwargs: Any) -> Any:
            engine = self.llm_engine
            staging = get_kv_transfer_group().worker_half.staging  # the worker role, in this process
            ids = [f"p{i}-{time.monotonic_ns()}-" for i in range(len(prompts))]
            for rid, prompt in zip(ids, prompts, strict=True):
                engine.add_request(rid, prompt, params)
            abort = {ids[i] for i in spec.get("abort", [])}
            outputs: dict[str, Any] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out
                probes["max_staged_bytes"] = max(probes["max_staged_bytes"], staging.held_bytes)
                # vLLM's engine core knows a request by its id plus a suffix: match kvdi's ids by prefix.
                # Each is aborted at the first step that finds it staging (their prefetches need not start
                # in the same step: aborting them together raced the second one's lookup).
                staged = {a for a in abort if any(r.startswith(a) for r in staging.requests)}
                if staged:  # the abort lands while their prefetch runs
                    probes["aborted_while_staging"] = sorted(
                        probes["aborted_while_staging"] + [ids.index(r) for r in staged]
                    )
                    engine.abort_request(sorted(staged))
                    abort -= staged
            core = engine.engine_core.engine_core
            for _ in range(1000):  # drain: held saves and dropped staging reach the worker
                if not core.scheduler.has_requests():
                    break
                core.step()
            planner = core.scheduler.connector.scheduler_half.prefetch
            probes.update(
                staged_bytes_at_end=staging.held_bytes,
                staged_requests_at_end=len(staging.requests),
                reserved_at_end=planner.reserved,
                fallbacks=planner.fallbacks,
                refused=staging.refused,
                requests_at_end=len(core.scheduler.requests),
            )
            aborted = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], finish_reason="abort")])
            return [outputs.get(rid, aborted) for rid in ids]

    vllm.LLM = ProbedLLM  # engine_run imports LLM from vllm inside run()
    result: dict[str, Any] = engine_run.run(spec)
    result["probes"] = probes
    return result


if __name__ == "__main__":
    from vllm_support import spec_main

    sys.exit(spec_main(sys.argv, run))
