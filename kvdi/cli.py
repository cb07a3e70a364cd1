"""The ``kvdi`` command: ``info``, ``connectors``, ``check``, ``demo``, ``bench``.

User errors (bad settings, unknown connector, V1 gate, impossible budget) print one line
on stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvdi.cli_store import add_store_parser
from kvdi.errors import ConfigError, KvdiError, did_you_mean

EXIT_USAGE = 2
BENCHES = ("resolution", "storage", "integrity", "redis", "s3", "ttft", "p2p", "async_transfers", "canonical")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvdi`` console script; returns the exit code."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command != "demo" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    command: Callable[[argparse.Namespace, list[str]], int] = args.func
    try:
        return command(args, rest)
    except KvdiError as exc:
        from kvdi.masking import mask_text

        print(f"kvdi: error: {_one_line(mask_text(str(exc)))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvdi", description="KV-cache connectors wired by a DI container.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="resolved settings with their sources, connector classes, allocation plan")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.set_defaults(func=cmd_info)
    conns = sub.add_parser("connectors", help="registered connectors and whether their dependencies are installed")
    conns.add_argument("--json", action="store_true", help="print JSON")
    conns.set_defaults(func=cmd_connectors)
    check = sub.add_parser(
        "check", help="validate settings, connector and allocation plan, open and probe the backend; exit 0 or 2"
    )
    check.add_argument(
        "--vllm-config",
        metavar="JSON",
        help="vLLM's --kv-transfer-config JSON: check what kvdi's vLLM adapter builds from it (kvdi.* keys included)",
    )
    check.set_defaults(func=cmd_check)
    demo = sub.add_parser(
        "demo", help="producer/consumer engines on the embedded default; the main job", add_help=False
    )
    demo.set_defaults(func=cmd_demo)
    bench = sub.add_parser("bench", help="ratio benchmarks: kvdi next to raw baselines in one run")
    bench.add_argument(
        "names", nargs="*", metavar="NAME", help=f"benchmarks to run: {', '.join(BENCHES)} (default: all)"
    )
    bench.add_argument("--quick", action="store_true", help="fewer, smaller iterations")
    bench.add_argument("--json", action="store_true", help="print JSON")
    bench.set_defaults(func=cmd_bench)
    add_store_parser(sub)  # kvdi store stats|verify|clear (kvdi.cli_store)
    return parser


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _source_of(path: str, sources: Mapping[str, str]) -> str:
    while path:
        if path in sources:
            return sources[path]
        path = path.rpartition(".")[0]
    return "default"


def describe(container_overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything ``kvdi info`` shows, as a dict: settings with sources, connector, plan."""
    from pydantic_core import to_jsonable_python

    from kvdi.containers import build_engine_container
    from kvdi.masking import mask_value
    from kvdi.settings import load_settings, value_sources

    overrides = dict(container_overrides or {})
    settings = load_settings(**overrides)
    sources = value_sources(**overrides)
    container = build_engine_container(settings)
    resolved = container.kv.connector()
    shown = _shown_settings(settings, resolved, container.kv.options(), container.kv.tiers())
    rows = [
        {"setting": p, "value": to_jsonable_python(mask_value(p, v)), "source": _source_of(p, sources)}
        for p, v in shown
    ]
    plan = container.alloc.plan()
    return {
        "settings": rows,
        "connector": {
            "name": resolved.spec.name,
            "origin": resolved.origin,
            "scheduler": f"{resolved.scheduler_cls.__module__}.{resolved.scheduler_cls.__qualname__}",
            "worker": f"{resolved.worker_cls.__module__}.{resolved.worker_cls.__qualname__}",
        },
        "allocation_plan": {
            "device": plan.device,
            "num_blocks": plan.num_blocks,
            "block_bytes": plan.block_bytes,
            "total_bytes": plan.total_bytes,
            "staging_bytes": plan.staging_bytes,
            "device_staging_bytes": plan.device_staging_bytes,
            "budget": plan.budget_source,
            "allocated": False,
        },
    }


def _shown_settings(settings: Any, resolved: Any, options: Any, tiers: Any) -> list[tuple[str, Any]]:
    """The core settings and the selected connector's options (its tiers' too): other connectors' sections are left
    out. A plugin's options are its model's fields under its name, e.g. ``myplugin.depth``."""
    from pydantic import BaseModel

    from kvdi.containers import options_model
    from kvdi.registry import BUILTIN_SPECS
    from kvdi.settings import flatten

    sections = {s.settings for s in BUILTIN_SPECS if isinstance(s.settings, str)}
    keep = {options_model(resolved), *(options_model(t.connector) for t in tiers)}
    rows = [
        (path, value) for path, value in flatten(settings.model_dump()) if path.partition(".")[0] not in sections - keep
    ]
    if isinstance(options, BaseModel) and not isinstance(options_model(resolved), str):
        rows += [(f"{resolved.spec.name.lower()}.{p}", v) for p, v in flatten(options.model_dump())]
    return rows


def cmd_info(args: argparse.Namespace, _rest: list[str]) -> int:
    """Print resolved settings (value and source), connector classes and the allocation plan."""
    info = describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(r["setting"]) for r in info["settings"])
    print("settings (value  [source: default|file|dotenv|env|init]):")
    for row in info["settings"]:
        print(f"  {row['setting']:<{width}} = {json.dumps(row['value'])}  [{row['source']}]")
    conn = info["connector"]
    print(f"connector: {conn['name']} ({conn['origin']})")
    print(f"  scheduler: {conn['scheduler']}")
    print(f"  worker:    {conn['worker']}")
    plan = info["allocation_plan"]
    print(
        f"allocation plan (not allocated): {plan['num_blocks']} blocks x {plan['block_bytes']} B = "
        f"{plan['total_bytes'] / 2**20:.1f} MiB on {plan['device']}; host staging {plan['staging_bytes']} B, "
        f"device staging {plan['device_staging_bytes']} B; "
        f"budget {plan['budget']}"
    )
    return 0


def connector_rows() -> list[dict[str, Any]]:
    """One row per registered connector; imports no connector module (and so not torch)."""
    from kvdi.registry import ConnectorRegistry

    rows = []
    for entry in ConnectorRegistry().all():
        spec = entry.spec
        missing = entry.missing_requirements
        rows.append(
            {
                "name": spec.name,
                "origin": entry.origin,
                "scheduler": spec.scheduler,
                "worker": spec.worker,
                "backend": spec.backend,
                "requires": list(spec.requires),
                "installed": not missing,
                "missing": list(missing),
                "description": spec.description,
            }
        )
    return rows


def cmd_connectors(args: argparse.Namespace, _rest: list[str]) -> int:
    """Print the registry as a table (or JSON)."""
    rows = connector_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvdi connectors (--json adds the scheduler and worker classes)")
    for col in ("name", "description", "backend", "origin", "deps"):
        table.add_column(col)
    for row in rows:
        deps = "ok" if row["installed"] else "missing: " + ", ".join(row["missing"])
        table.add_row(row["name"], row["description"] or "-", row["backend"] or "-", row["origin"], deps)
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def cmd_check(args: argparse.Namespace, _rest: list[str]) -> int:
    """Validate settings, connector and allocation plan, then open, probe and close the backend; print one ok line.

    With ``--vllm-config JSON`` the settings are those kvdi's vLLM adapter builds from that
    ``--kv-transfer-config``: its ``kvdi.*`` extra-config keys over ``KVDI_*`` env, ``.env``, file.
    """
    from kvdi.cli_check import check_warnings
    from kvdi.containers import build_engine_container
    from kvdi.settings.loading import errors_as_written
    from kvdi.settings.vllm_compat import transfer_key

    settings, overrides = _check_settings(args.vllm_config)
    with errors_as_written(overrides, transfer_key("--vllm-config")):  # backend errors name the JSON key too
        container = build_engine_container(settings)
        resolved = container.kv.connector()
        container.alloc.plan()  # an impossible budget fails here; its block count is the reference engine's, not vLLM's
        summary = _probe_backend(container, resolved.spec.name)
        warnings = check_warnings(settings, container, summary)
    print(
        f"ok: connector {resolved.spec.name} ({resolved.origin}); backend: {_one_line(summary)}"
        + "".join(f"\nwarning: {w}" for w in warnings)
    )
    if args.vllm_config is not None:
        from kvdi.integrations.vllm.config import load_failure_outcome

        print(load_failure_outcome(args.vllm_config))
    return 0


def _check_settings(vllm_config: str | None) -> tuple[Any, dict[str, Any]]:
    """Settings for ``kvdi check`` and the overrides read from ``vllm_config`` (none without it); with vLLM's JSON,
    as the adapter builds them, errors naming the JSON key."""
    from kvdi.cli_check import check_connector_names, json_error
    from kvdi.settings import load_settings
    from kvdi.settings.loading import errors_as_written
    from kvdi.settings.vllm_compat import adapter_overrides, transfer_key

    if vllm_config is None:
        return load_settings(), {}
    try:
        data = json.loads(vllm_config)
    except json.JSONDecodeError as exc:
        raise json_error(exc) from None
    except (ValueError, RecursionError):
        raise ConfigError("--vllm-config is not valid JSON; pass vLLM's --kv-transfer-config JSON object") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--vllm-config must be a JSON object, got {type(data).__name__}")
    check_connector_names(data)
    overrides = adapter_overrides(data, "--vllm-config")
    with errors_as_written(overrides, transfer_key("--vllm-config")):
        return load_settings(**overrides), overrides


def _probe_backend(container: Any, name: str) -> str:
    """Open the selected connector's backend, call its optional ``check()``, shut it down; the summary line.

    A p2p backend waits for its peer here (up to ``KVDI_P2P__CONNECT_TIMEOUT_S``). Failures that
    are not KvdiErrors become :class:`~kvdi.errors.BackendUnavailableError` with URLs masked.
    """
    from kvdi.errors import BackendUnavailableError
    from kvdi.masking import mask_text

    try:
        backend = container.kv.backend()
        if backend is None:
            return "none (this connector has no shared backend)"
        check = getattr(backend, "check", None)
        return str(check()) if callable(check) else f"{type(backend).__name__} opened"
    except KvdiError:
        raise
    except Exception as exc:
        raise BackendUnavailableError(
            f"connector {name!r}: backend cannot be opened: {type(exc).__name__}: {mask_text(str(exc))}"
        ) from None
    finally:
        container.shutdown_resources()


def cmd_demo(_args: argparse.Namespace, rest: list[str]) -> int:
    """Run the producer/consumer demo (see kvdi.demo)."""
    from kvdi.demo import main as demo_main

    return demo_main(rest)


def cmd_bench(args: argparse.Namespace, _rest: list[str]) -> int:
    """Run ratio benchmarks and print a table (or JSON)."""
    from kvdi.bench import BenchResult

    names = args.names or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        raise ConfigError(
            f"unknown benchmark {unknown[0]!r}; known: {', '.join(BENCHES)}{did_you_mean(unknown[0], BENCHES)}"
        )
    results: list[BenchResult] = []
    skipped: dict[str, str] = {}
    for name in names:
        try:
            module = importlib.import_module(f"kvdi.bench.{name}")
        except ImportError as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        results.extend(module.run(args.quick))
    if args.json:
        print(json.dumps({"results": [r.as_dict() for r in results], "skipped": skipped}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvdi bench (ratio = kvdi / baseline, same bytes, same run)")
    for col in ("bench", "metric", "kvdi", "baseline", "ratio", "target", "met", "note"):
        table.add_column(col)
    for r in results:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        target = "-" if r.target is None else f"{'>=' if r.higher_is_better else '<='} {r.target:g}"
        table.add_row(
            r.bench,
            r.metric,
            f"{r.kvdi:.3g} {r.unit}",
            f"{r.baseline:.3g} {r.unit} ({r.baseline_name})",
            f"{r.ratio:.2f}x",
            target,
            met,
            r.note,
        )
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    for name, why in skipped.items():
        console.print(f"skipped {name}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
