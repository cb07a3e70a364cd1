"""kvdi's vLLM connector, switchable at run time to the do-nothing connector: an A/B inside one server.

Across ``vllm serve`` processes the same connector's inter-token latency differs by 5-10 % on a 2-core machine
(``docs/bench-serve-power.md``): comparing kvdi with the do-nothing connector across servers cannot decide a
3 % bar. :class:`SwitchConnector` is kvdi's :class:`~kvdi.integrations.vllm.KvdiConnector` (built, configured and
registered as usual) whose per-step and per-request hooks each answer either as kvdi or as
:class:`.noop_connector.NoopConnector` (vLLM's base class defaults included), after one check of a process-wide
flag. ``SIGUSR1`` flips the flag in the process that gets it; the benchmark (:mod:`.bench_serve_switch`) signals
the engine core and the worker only while the server is idle (no request in flight), so a request starts and
ends in one mode. Both modes pay the same check, so the difference between them is what kvdi's hooks cost.

Every instance writes its pid, role, mode, hook times (:data:`TIMES`: per mode and hook, calls and nanoseconds
inside, timed alike in both modes) and garbage collections (:data:`GC`: per mode, by generation, and their time,
wherever in the process they ran, inside the hooks or not: what kvdi's objects may cost outside its hooks) as JSON
to ``$BENCH_SWITCH_DIR/<pid>`` when it starts and after each flip: the benchmark signals exactly those processes,
waits for their acknowledgements and reads what kvdi's hooks took. ``BENCH_SWITCH_START`` (``noop`` or ``kvdi``) is
the first mode. A benchmark's test double, never used by kvdi itself.
"""

from __future__ import annotations

import gc
import json
import os
import signal
from pathlib import Path
from time import perf_counter_ns
from typing import Any

from benchmarks.vllm.bench_serve_switch import MODES
from benchmarks.vllm.noop_connector import NoopConnector
from kvdi.integrations.vllm import KvdiConnector

KVDI = [os.environ.get("BENCH_SWITCH_START", "noop") == "kvdi"]
"""The process's mode: True answers as kvdi, False as the do-nothing connector."""

SWITCHED = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
    "request_finished_all_groups", "update_connector_output", "has_pending_block_frees", "has_pending_push_work",
    "take_events", "get_external_cache_hit_sources", "bind_connector_metadata", "clear_connector_metadata",
    "handle_preemptions", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
    "get_transfer_results", "get_block_ids_with_load_errors", "build_connector_worker_meta",
    "get_kv_connector_kv_cache_events", "get_kv_connector_stats",
)  # fmt: skip
"""kvdi's hooks that vLLM calls per step or per request: each answers by the mode. Registration, shutdown,
class-level hooks and properties stay kvdi's in both modes."""


ROLE = [""]
"""This process's connector role (``scheduler`` or ``worker``), in its reports."""

TIMES: dict[str, dict[str, list[int]]] = {mode: {} for mode in MODES}
"""Per mode, per hook: [calls, nanoseconds inside the hook] in this process (both modes time alike)."""


GC: dict[str, list[int]] = {mode: [0, 0, 0, 0] for mode in MODES}
"""Per mode: this process's garbage collections of generation 0, 1 and 2, and the nanoseconds they took."""
_GC_START = [0]


def _collected(phase: str, info: dict[str, int]) -> None:
    """``gc.callbacks``' hook: each collection, and its time, counted to the mode the process is in."""
    if phase == "start":
        _GC_START[0] = perf_counter_ns()
        return
    kept = GC[MODES[KVDI[0]]]
    kept[info["generation"]] += 1
    kept[3] += perf_counter_ns() - _GC_START[0]


def _acknowledge() -> None:
    folder = os.environ.get("BENCH_SWITCH_DIR")
    if folder:  # written whole, then renamed: the benchmark never reads half a line
        tmp = Path(folder, f".{os.getpid()}.tmp")
        tmp.write_text(
            json.dumps({"pid": os.getpid(), "role": ROLE[0], "mode": MODES[KVDI[0]], "times": TIMES, "gc": GC})
        )
        os.replace(tmp, Path(folder, str(os.getpid())))


def _flip(signum: int, frame: Any) -> None:
    KVDI[0] = not KVDI[0]
    _acknowledge()


def _finished_all_groups(self: Any, request: Any, block_ids: Any) -> tuple[bool, None]:
    return False, None  # vLLM's SupportsHMA hook, as the base class's request_finished answers


def _switched(name: str) -> Any:
    as_kvdi = getattr(KvdiConnector, name)
    as_noop = _finished_all_groups if name == "request_finished_all_groups" else getattr(NoopConnector, name)

    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        mode = KVDI[0]
        start = perf_counter_ns()
        try:
            return (as_kvdi if mode else as_noop)(self, *args, **kwargs)
        finally:
            took = perf_counter_ns() - start
            kept = TIMES[MODES[mode]].setdefault(name, [0, 0])
            kept[0] += 1
            kept[1] += took

    hook.__name__ = name
    return hook


class SwitchConnector(KvdiConnector):  # type: ignore[misc,unused-ignore]
    """:class:`KvdiConnector`, each of :data:`SWITCHED` answered as kvdi or as the do-nothing connector."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        ROLE[0] = "scheduler" if self.role.name == "SCHEDULER" else "worker"
        signal.signal(signal.SIGUSR1, _flip)  # vLLM builds connectors on each process's main thread
        if _collected not in gc.callbacks:
            gc.callbacks.append(_collected)
        _acknowledge()


for _name in SWITCHED:
    if hasattr(KvdiConnector, _name):
        setattr(SwitchConnector, _name, _switched(_name))
