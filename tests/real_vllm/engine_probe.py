"""``engine_run.py`` plus what vLLM's own scheduler sees of kvdi's pending work (in-process engines only).

Usage: ``python tests/real_vllm/engine_probe.py SPEC.json``; the spec is ``engine_run.py``'s, and
the result gains ``probes``:

- ``requires_kv_delivery``: the value vLLM's scheduler took from the connector at start;
- ``pending_push_work_after_generate``: ``has_pending_push_work()`` when each round returned
  (the last requests' saves are still held then);
- ``pending_push_work_at_end`` / ``requests_at_end``: the same once the engine drained;
- ``preemptions``: how many times vLLM preempted a running request;
- ``step_clock``: whether ``slow_store``'s hold counts this engine's scheduler steps;
- ``pending_frees_consulted`` / ``pending_frees_true``: how often vLLM asked
  ``has_pending_block_frees()`` instead of preempting, and how often kvdi answered True.

Spec keys: ``pending_frees`` (default true): false makes the connector answer
``has_pending_block_frees()`` with False, as a connector without the hook would, to compare;
``max_tokens_each``: per-prompt ``max_tokens`` (cycled), so requests end at different steps;
``settle_s``: seconds to sleep after each round, so slow background saves land before the drain.
"""

from __future__ import annotations

import sys
import time
from typing import Any


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import engine_run  # type: ignore[import-not-found,unused-ignore]
    import vllm
    from vllm import SamplingParams
    from vllm.entrypoints.llm import LLM

    probes: dict[str, Any] = {"pending_push_work_after_generate": [], "preemptions": 0}
    probes.update(pending_frees_consulted=0, pending_frees_true=0)
    held: list[Any] = []

    class ProbedLLM(LLM):  # type: ignore[misc,unused-ignore]
        """vLLM's LLM, with counters on its scheduler's preemptions and kvdi's pending-work answers."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            scheduler = self.llm_engine.engine_core.engine_core.scheduler
            held.append(scheduler)
            connector = scheduler.connector
            probes["requires_kv_delivery"] = scheduler.requires_kv_delivery
            preempt = scheduler._preempt_request
            answer = connector.has_pending_block_frees if spec.get("pending_frees", True) else (lambda: False)

            def counted_preempt(*args: Any, **kw: Any) -> Any:
                probes["preemptions"] += 1
                return preempt(*args, **kw)

            def counted_frees() -> bool:
                probes["pending_frees_consulted"] += 1
                pending = bool(answer())
                probes["pending_frees_true"] += pending
                return pending

            scheduler._preempt_request = counted_preempt
            connector.has_pending_block_frees = counted_frees
            probes["step_clock"] = "slow_store" in sys.modules
            if probes["step_clock"]:  # the slow store's hold counts this engine's steps, not seconds
                tick, schedule = sys.modules["slow_store"].tick, scheduler.schedule

                def ticked_schedule(*args: Any, **kw: Any) -> Any:
                    tick()
                    return schedule(*args, **kw)

                scheduler.schedule = ticked_schedule

        def generate(self, prompts: Any, params: Any, **kwargs: Any) -> Any:
            if spec.get("max_tokens_each"):  # requests that end at different steps
                each = spec["max_tokens_each"]
                params = [
                    SamplingParams(temperature=0.0, max_tokens=each[i % len(each)], ignore_eos=True)
                    for i in range(len(prompts))
                ]
            out = super().generate(prompts, params, **kwargs)
            probes["pending_push_work_after_generate"].append(held[0].connector.has_pending_push_work())
            time.sleep(spec.get("settle_s", 0))  # let slow background saves land before the drain's bounded steps
            return out

    vllm.LLM = ProbedLLM  # engine_run imports LLM from vllm inside run()
    result: dict[str, Any] = engine_run.run(spec)
    scheduler = held[0]
    probes["pending_push_work_at_end"] = scheduler.connector.has_pending_push_work()
    probes["requests_at_end"] = len(scheduler.requests)
    result["probes"] = probes
    return result


if __name__ == "__main__":
    from vllm_support import spec_main

    sys.exit(spec_main(sys.argv, run))
