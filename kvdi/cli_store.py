"""``kvdi store stats|verify|clear``: what the selected connector's shared store holds, checked, emptied.

Exit codes: 0 done (``verify``: every object good), 1 ``verify`` found bad objects (listed;
removed with ``--drop``), 2 a bad setting, an unreachable store or a refused ``clear`` (one
line on stderr, as every ``kvdi`` command). Long work shows a progress bar on a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvdi.errors import BackendUnavailableError, ConfigError, KvdiError

if TYPE_CHECKING:
    from kvdi.admin import StoreAdmin
    from kvdi.settings import KvdiSettings

EXIT_BAD_OBJECTS = 1


def add_store_parser(sub: Any) -> None:
    """Register ``store`` and its subcommands on the ``kvdi`` parser's subparsers."""
    store = sub.add_parser("store", help="administer the selected connector's shared store: stats, verify, clear")
    actions = store.add_subparsers(dest="store_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--connector", help="connector whose store to use (default: KVDI_KV_CONNECTOR)")
    common.add_argument("--json", action="store_true", help="print JSON")
    stats = actions.add_parser("stats", parents=[common], help="objects, bytes, oldest and newest, per folder or node")
    stats.set_defaults(func=cmd_store_stats)
    verify = actions.add_parser("verify", parents=[common], help="read and check every object; exit 1 if any is bad")
    verify.add_argument("--drop", action="store_true", help="remove the bad kvdi objects (never foreign entries)")
    verify.set_defaults(func=cmd_store_verify)
    clear = actions.add_parser("clear", parents=[common], help="remove every kvdi object (asks first)")
    clear.add_argument("--yes", action="store_true", help="do not ask")
    clear.add_argument("--dry-run", action="store_true", help="remove nothing: list what would be removed")
    clear.set_defaults(func=cmd_store_clear)


@contextlib.contextmanager
def _opened(args: argparse.Namespace) -> Iterator[tuple[StoreAdmin, KvdiSettings]]:
    """The store, closed afterwards; a failure of the store while in use is one line (exit 2)."""
    from kvdi.admin import open_admin
    from kvdi.masking import mask_text
    from kvdi.settings import load_settings

    settings = load_settings()
    admin = open_admin(settings, args.connector)
    try:
        yield admin, settings
    except KvdiError:
        raise
    except Exception as exc:
        raise BackendUnavailableError(
            f"{admin.kind} at {admin.where}: {type(exc).__name__}: {mask_text(str(exc))}"
        ) from None
    finally:
        with contextlib.suppress(Exception):
            admin.close()


def _section(settings: KvdiSettings, admin: StoreAdmin) -> dict[str, Any]:
    """The store's settings section as JSON (secrets shown as ``**********``)."""
    name = "shared_storage" if admin.kind == "shared_storage" else "redis"
    section = getattr(settings, name)
    return {name: json.loads(section.model_dump_json())}


@contextlib.contextmanager
def _progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr when it is a terminal; otherwise a callback that does nothing."""
    if not sys.stderr.isatty():
        yield lambda done, total: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _when(stamp: float | None) -> str:
    return "-" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def cmd_store_stats(args: argparse.Namespace, _rest: list[str]) -> int:
    from kvdi.admin import store_stats

    with _opened(args) as (admin, settings):
        stats = store_stats(admin)
        info = {**stats.as_dict(), "settings": _section(settings, admin)}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvdi store: {stats.kind} at {stats.where}")
    for col in ("group", "objects", "bytes", "oldest", "newest"):
        table.add_column(col, justify="right" if col in ("objects", "bytes") else "left")
    for name, group in sorted(stats.groups.items()):
        table.add_row(name, str(group.objects), str(group.bytes), _when(group.oldest), _when(group.newest))
    t = stats.total
    table.add_row("total", str(t.objects), str(t.bytes), _when(t.oldest), _when(t.newest), style="bold")
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    console.print(
        f"other entries (not kvdi objects, left alone): {stats.other}; foreign entries under object names "
        f"(no kvdi frame, left alone): {stats.foreign}, of them odd (no plain object): {stats.odd}"
    )
    console.print(f"settings: {json.dumps(info['settings'])}")
    return 0


def cmd_store_verify(args: argparse.Namespace, _rest: list[str]) -> int:
    from kvdi.admin import verify_store
    from kvdi.connectors.store.integrity import frame_key

    with _opened(args) as (admin, settings), _progress("verifying") as progress:
        report = verify_store(admin, frame_key(settings), drop=args.drop, progress=progress)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        for bad in report.bad:
            print(f"bad: {bad.group}/{bad.name} ({bad.reason}){' dropped' if bad.dropped else ''}")
        for foreign in report.foreign:
            print(f"foreign: {foreign.group}/{foreign.name} ({foreign.why}), left alone")
        print(
            f"{report.kind} at {report.where}: {report.checked} objects checked, {report.good} good, "
            f"{len(report.bad)} bad{' (dropped)' if args.drop and report.bad else ''}, "
            f"{len(report.foreign)} foreign (left alone) in {report.seconds:.2f} s"
        )
    return EXIT_BAD_OBJECTS if report.bad else 0


def cmd_store_clear(args: argparse.Namespace, _rest: list[str]) -> int:
    from kvdi.admin import clear_store, store_stats

    with _opened(args) as (admin, _settings):
        if not args.yes and not args.dry_run:
            count = store_stats(admin).total.objects
            if not sys.stdin.isatty():
                raise ConfigError(f"kvdi store clear: would remove {count} objects from {admin.where}; add --yes")
            answer = input(f"remove all {count} objects from {admin.kind} at {admin.where}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing removed")
                return 0
        with _progress("clearing") as progress:
            report = clear_store(admin, progress, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report.as_dict()))
        return 0
    if args.dry_run:
        for obj in report.removed:
            print(f"would remove: {obj.group}/{obj.name} ({obj.size} B)")
    done = "would remove" if args.dry_run else "removed"
    print(
        f"{done} {len(report.removed)} objects from {admin.kind} at {admin.where}; "
        f"{len(report.foreign)} foreign entries left alone"
    )
    return 0


__all__ = ["add_store_parser"]
