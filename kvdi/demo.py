"""``kvdi demo``: a producer engine saves KV, a fresh consumer engine loads it, a null engine recomputes.

All three engines are built from their own :func:`~kvdi.containers.build_engine_container`
in this process, from the same settings (``KVDI_*`` env, ``KVDI_SETTINGS_FILE``) except
``kv_role`` and, for the baseline, ``kv_connector=null``. The demo prints prompt tokens,
tokens loaded vs computed, bytes moved, time to first token with the cache vs recomputed,
and whether the consumer generated exactly the baseline's tokens. Exit status 0 means
identical tokens and at least one loaded token; 1 means not; 2 means bad settings or a
connector the demo cannot run (:func:`cannot_demo` says why: the demo's engines run one after
the other in one process, so it needs a store that outlives an engine). Unless ``--keep``, the
demo discards every block it stored before it exits (a Redis server keeps nothing of it).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdi.masking import mask_text

if TYPE_CHECKING:
    from kvdi.engine.engine import EngineConnectorStats, RequestOutput

DEFAULT_PROMPTS = 4
DEFAULT_PROMPT_LEN = 1024
DEFAULT_NEW_TOKENS = 8
SEED = 1234
NEEDS_A_PEER = ("p2p",)
"""Connectors that move KV between two live processes (a producer and its consumer); the demo has one."""


@dataclass(frozen=True)
class DemoOptions:
    """What ``kvdi demo`` runs; ``store_dir`` None means a temporary directory removed afterwards."""

    json: bool = False
    prompts: int = DEFAULT_PROMPTS
    prompt_len: int = DEFAULT_PROMPT_LEN
    new_tokens: int = DEFAULT_NEW_TOKENS
    store_dir: Path | None = None
    keep: bool = False


@dataclass(frozen=True)
class DemoReport:
    """The figures the demo shows (and prints as JSON with ``--json``)."""

    connector: str
    device: str
    prompts: int
    prompt_tokens: int
    new_tokens: int
    loaded_tokens: int
    computed_tokens: int
    baseline_computed_tokens: int
    bytes_saved: int
    bytes_loaded: int
    consumer_counters: dict[str, int | float]
    ttft_recompute_s: float
    ttft_cached_s: float
    ttft_speedup: float
    max_first_logit_diff: float
    errors: list[str]
    identical: bool
    discarded_blocks: int = 0

    @property
    def ok(self) -> bool:
        return self.identical and self.loaded_tokens > 0 and not self.errors

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def make_prompts(count: int, length: int, vocab_size: int, seed: int = SEED) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` token ids, the same in every run."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def cannot_demo(container: Any) -> str | None:
    """Why the demo cannot show a load with the engine container's connector, or None when it can."""
    spec = container.kv.connector().spec
    tiers = container.kv.tiers()
    if spec.backend is None:
        return f"connector {spec.name!r} stores nothing"
    if spec.name in NEEDS_A_PEER:
        return (
            f"connector {spec.name!r} sends KV from a live producer process to a live consumer process; "
            "run containers/disagg_pair.py for it"
        )
    local = [t.name for t in tiers if t.connector.spec.process_local] if tiers else []
    if (tiers and len(local) == len(tiers)) or (not tiers and spec.process_local):
        where = f"all its tiers ({', '.join(local)}) keep" if tiers else "it keeps"
        return (
            f"connector {spec.name!r}: {where} blocks in one engine's memory, and the demo's consumer is a fresh engine"
        )
    return None


def run_demo(options: DemoOptions, **overrides: Any) -> int:
    """Run the demo, print the table (or JSON) and return the exit status. ``overrides`` are settings kwargs."""
    # A KvdiError (bad settings, a plan that does not fit, a backend that cannot open) goes up to
    # the CLI, which prints it as one masked line on stderr and exits 2.
    if options.store_dir is not None:
        report = measure(options, options.store_dir, overrides)
    else:
        with tempfile.TemporaryDirectory(prefix="kvdi-demo-") as tmp:
            report = measure(options, Path(tmp), overrides)
    if options.json:
        print(mask_text(json.dumps(report.as_dict())))
    else:
        print_report(report)
    return 0 if report.ok else 1


def measure(options: DemoOptions, store_dir: Path, overrides: dict[str, Any]) -> DemoReport:
    """Build the three engines one after the other and collect the figures."""
    from kvdi.containers import build_engine_container
    from kvdi.errors import ConfigError
    from kvdi.settings import load_settings

    base = load_settings(**overrides)
    why = cannot_demo(build_engine_container(base))
    if why is not None:
        raise ConfigError(
            f"kvdi demo cannot run this connector: {why}. It runs shared_storage (the default), redis, or multi "
            "with a shared tier; set KVDI_KV_CONNECTOR"
        )
    allocator = base.allocator.model_dump()
    blocks_per_prompt = -(-(options.prompt_len + options.new_tokens) // base.allocator.block_size)
    if allocator["num_blocks"] is None and allocator["memory_fraction"] is None:
        allocator["num_blocks"] = blocks_per_prompt * min(options.prompts, base.scheduler.max_num_seqs) + 1
    storage = {**base.shared_storage.model_dump(), "path": store_dir}
    common = {**overrides, "allocator": allocator, "shared_storage": storage}
    prompts = make_prompts(options.prompts, options.prompt_len, base.model.vocab_size)

    with _Progress(enabled=not options.json, per_phase=len(prompts)) as progress:

        def run(phase: str, clean: bool = False, **settings: Any) -> tuple[list[RequestOutput], EngineConnectorStats]:
            container = build_engine_container(**{**common, **settings})
            try:
                engine = container.engine()
                engine.generate([prompts[0][:8]], 1)  # warm-up: first-call overheads are not prefill
                outs: list[RequestOutput] = []
                for prompt in prompts:  # one at a time: time to first token is then prefill, not queueing
                    outs.extend(engine.generate([prompt], options.new_tokens))
                    progress.advance(phase)
                stats = engine.connector_stats()
                engine.shutdown()
                if clean:
                    discarded.append(discard_stored(container, outs))
                devices.append(container.alloc.plan().device)
                return outs, stats
            finally:
                container.shutdown_resources()

        discarded: list[int] = []
        devices: list[str] = []
        baseline, _ = run("recompute (null connector)", kv_connector="null")
        _produced, produced_stats = run("producer (saves KV)", kv_role="kv_producer")
        consumed, consumed_stats = run("consumer (loads KV)", clean=not options.keep, kv_role="kv_consumer")

    report = _report(options, base.kv_connector, devices[0], baseline, consumed, produced_stats, consumed_stats)
    return replace(report, discarded_blocks=sum(discarded))


def discard_stored(container: Any, outs: Sequence[RequestOutput]) -> int:
    """Discard every block the demo's requests may have stored (prompt and generated tokens); how many keys."""
    from kvdi.connectors.store.keys import block_keys

    backend = container.kv.backend()
    discard = getattr(backend, "discard", None)
    if not callable(discard):
        return 0
    layout = container.kv.layout()
    keys = {key for o in outs for key in block_keys([*o.prompt_token_ids, *o.output_token_ids], layout)}
    for key in keys:
        discard(key)
    return len(keys)


def _report(
    options: DemoOptions,
    connector: str,
    device: str,
    baseline: list[RequestOutput],
    consumed: list[RequestOutput],
    produced_stats: EngineConnectorStats,
    consumed_stats: EngineConnectorStats,
) -> DemoReport:
    errors = [o.error for o in (*baseline, *consumed) if o.error]
    diffs = [
        float((c.first_token_logits - b.first_token_logits).abs().max())
        for b, c in zip(baseline, consumed, strict=True)
        if c.first_token_logits is not None and b.first_token_logits is not None
    ]
    recompute = statistics.median(o.time_to_first_token_s or 0.0 for o in baseline)
    cached = statistics.median(o.time_to_first_token_s or 0.0 for o in consumed)
    return DemoReport(
        connector=connector,
        device=device,
        prompts=len(baseline),
        prompt_tokens=sum(len(o.prompt_token_ids) for o in consumed),
        new_tokens=options.new_tokens,
        loaded_tokens=sum(o.num_loaded_tokens for o in consumed),
        computed_tokens=sum(o.num_computed_prompt_tokens for o in consumed),
        baseline_computed_tokens=sum(o.num_computed_prompt_tokens for o in baseline),
        bytes_saved=produced_stats.total.saved_bytes,
        bytes_loaded=consumed_stats.total.loaded_bytes,
        consumer_counters=consumed_stats.total.as_dict(),
        ttft_recompute_s=recompute,
        ttft_cached_s=cached,
        ttft_speedup=recompute / cached if cached > 0 else 0.0,
        max_first_logit_diff=max(diffs, default=0.0),
        errors=errors,
        identical=not errors and [o.output_token_ids for o in consumed] == [o.output_token_ids for o in baseline],
    )


def print_report(report: DemoReport) -> None:
    """The rich table of :class:`DemoReport`."""
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"kvdi demo: {report.prompts} prompts, {report.connector}, {report.device}", title_justify="left"
    )
    table.add_column("figure", min_width=34)
    table.add_column("value", justify="right")
    rows = [
        ("prompt tokens", f"{report.prompt_tokens}"),
        ("tokens loaded (consumer)", f"{report.loaded_tokens}"),
        ("tokens computed (consumer)", f"{report.computed_tokens}"),
        ("tokens computed (recompute)", f"{report.baseline_computed_tokens}"),
        ("bytes saved (producer)", f"{report.bytes_saved:,}"),
        ("bytes loaded (consumer)", f"{report.bytes_loaded:,}"),
        (
            "consumer lookups / hit blocks",
            f"{report.consumer_counters['lookups']} / {report.consumer_counters['lookup_hit_blocks']}",
        ),
        (
            "corrupt dropped / load failures",
            f"{report.consumer_counters['corrupt_dropped']} / {report.consumer_counters['load_failures']}",
        ),
        ("time to first token, recompute", f"{report.ttft_recompute_s * 1e3:.1f} ms"),
        ("time to first token, with cache", f"{report.ttft_cached_s * 1e3:.1f} ms"),
        ("speedup", f"{report.ttft_speedup:.2f}x"),
        ("max |first-token logit diff|", f"{report.max_first_logit_diff:.2e}"),
        ("identical", "yes" if report.identical else "no"),
        ("blocks discarded afterwards", f"{report.discarded_blocks}" if report.discarded_blocks else "none (--keep)"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console = Console()
    console.print(table)
    for error in report.errors:
        console.print(f"[red]error:[/red] {mask_text(error)}")
    if report.loaded_tokens == 0:
        console.print(
            f"[yellow]nothing was loaded:[/yellow] the consumer engine did not find the producer's KV through "
            f"{report.connector!r}; the demo needs a store both engines reach (shared_storage, redis)"
        )


class _Progress:
    """A rich progress bar per phase (nothing when disabled, e.g. with ``--json``)."""

    def __init__(self, enabled: bool, per_phase: int) -> None:
        self.enabled = enabled
        self._tasks: dict[str, Any] = {}
        self._bar: Any = None
        self._total = per_phase

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, phase: str) -> None:
        if self._bar is None:
            return
        if phase not in self._tasks:
            self._tasks[phase] = self._bar.add_task(phase, total=self._total)
        self._bar.advance(self._tasks[phase])


def parse_args(argv: Sequence[str] | None) -> DemoOptions:
    parser = argparse.ArgumentParser(
        prog="kvdi demo",
        description="A producer engine saves KV, a fresh consumer engine loads it, a null-connector engine "
        "recomputes; exit 0 when the consumer's tokens are identical and it loaded tokens. Runs shared_storage "
        "(default), redis and multi with a shared tier; not null, cpu_offload (one process's memory) or p2p "
        "(two live processes). Discards what it stored unless --keep.",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--prompts", type=_positive, default=DEFAULT_PROMPTS, help="number of prompts")
    parser.add_argument("--prompt-len", type=_positive, default=DEFAULT_PROMPT_LEN, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=_positive, default=DEFAULT_NEW_TOKENS, help="tokens to generate")
    parser.add_argument("--store-dir", type=Path, default=None, help="shared_storage directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the blocks the demo stored (default: discard them)")
    args = parser.parse_args(argv)
    return DemoOptions(args.json, args.prompts, args.prompt_len, args.new_tokens, args.store_dir, args.keep)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvdi demo [--json] [--prompts N] [--prompt-len N] [--new-tokens N] [--store-dir DIR]``."""
    return run_demo(parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
