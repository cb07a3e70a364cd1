"""``kvdi store stats|verify|clear``: what the selected connector's shared store holds, checked, emptied.

``--layout FP`` (a layout fingerprint or a prefix of one, as ``stats`` lists them: one per
model and shape) and ``--older-than AGE`` (``7d``, ``12h``, ``3600``) select objects by their
content and age; ``clear`` with either lists what it would remove unless ``--yes`` is given.
Canonical sections (``format=canonical``) are kvdi objects like per-rank frames: ``stats`` lists
them as ``canonical:<fingerprint>`` rows (``canonical_v1:`` for an older format version) with a
count per format, ``verify`` checks them as a load does, ``clear`` removes them.

Exit codes: 0 done (``verify``: every object good), 1 ``verify`` found bad objects (listed;
removed with ``--drop``), 2 a bad setting, an unreachable store or a refused ``clear`` (one
line on stderr, as every ``kvdi`` command). Long work shows a progress bar on a terminal and,
elsewhere (a log, a CI job), a progress line on stderr every :data:`PROGRESS_EVERY_S` seconds
and one when done.
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
    from kvdi.admin import Selection, StoreAdmin
    from kvdi.settings import KvdiSettings

EXIT_BAD_OBJECTS = 1
PROGRESS_EVERY_S = 5.0


def add_store_parser(sub: Any) -> None:
    """Register ``store`` and its subcommands on the ``kvdi`` parser's subparsers."""
    store = sub.add_parser("store", help="administer the selected connector's shared store: stats, verify, clear")
    actions = store.add_subparsers(dest="store_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--connector", help="connector whose store to use (default: KVDI_KV_CONNECTOR)")
    common.add_argument("--json", action="store_true", help="print JSON")
    common.add_argument("--layout", metavar="FP", help="only objects of this layout fingerprint (or prefix)")
    common.add_argument("--older-than", metavar="AGE", help="only objects unused for AGE (7d, 12h, 30m, 3600)")
    stats = actions.add_parser("stats", parents=[common], help="objects, bytes, oldest and newest, per layout (model)")
    stats.set_defaults(func=cmd_store_stats)
    verify = actions.add_parser("verify", parents=[common], help="read and check every object; exit 1 if any is bad")
    verify.add_argument("--drop", action="store_true", help="remove the bad kvdi objects (never foreign entries)")
    verify.set_defaults(func=cmd_store_verify)
    clear = actions.add_parser(
        "clear", parents=[common], help="remove kvdi objects (asks first; with --layout/--older-than: a dry run)"
    )
    clear.add_argument("--yes", action="store_true", help="do not ask; with a filter: really remove")
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


def _selection(args: argparse.Namespace) -> Selection:
    from kvdi.admin import Selection, parse_age, parse_layout

    layout = parse_layout(args.layout) if args.layout is not None else ""
    older = parse_age(args.older_than) if args.older_than is not None else None
    return Selection(layout, older)


def _section(settings: KvdiSettings, admin: StoreAdmin) -> dict[str, Any]:
    """The store's settings section as JSON (secrets shown as ``**********``, file modes in octal). For Redis
    the TTL is left out: the CLI's setting says nothing of what the engines wrote (``server`` has the keys' own)."""
    if admin.kind == "s3":
        from kvdi.admin.s3_admin import s3_options

        return {"s3": json.loads(s3_options(settings).model_dump_json())}
    if admin.kind == "shared_storage":
        section = json.loads(settings.shared_storage.model_dump_json())
        section["mode"] = oct(settings.shared_storage.mode)
        return {"shared_storage": section}
    section = json.loads(settings.redis.model_dump_json())
    section.pop("ttl_s", None)
    return {"redis": section}


class _Lines:
    """Progress as lines on stderr (not a terminal): every :data:`PROGRESS_EVERY_S` seconds and at the end."""

    def __init__(self, label: str) -> None:
        self.label, self.start, self.last = label, time.monotonic(), time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done == total or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            share = f" ({100 * done // total}%)" if total else ""
            print(
                f"kvdi store {self.label}: {done}/{total} objects{share}, {now - self.start:.1f} s",
                file=sys.stderr,
                flush=True,
            )


@contextlib.contextmanager
def _progress(label: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr when it is a terminal; otherwise progress lines (:class:`_Lines`)."""
    if not sys.stderr.isatty():
        yield _Lines(label)
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


_FORMATS = {"per_rank": "per-rank frames", "canonical": "canonical sections"}
"""How ``stats`` names a format (``canonical_v1``: an older canonical version, never loaded, as it is)."""


def _when(stamp: float | None) -> str:
    return "-" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cmd_store_stats(args: argparse.Namespace, _rest: list[str]) -> int:
    from kvdi.admin import store_stats

    selection = _selection(args)
    with _opened(args) as (admin, settings), _progress("stats") as progress:
        stats = store_stats(admin, selection, progress)
        info = {**stats.as_dict(), "settings": _section(settings, admin)}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    picked = f" ({stats.selected})" if stats.selected else ""
    table = Table(title=f"kvdi store: {stats.kind} at {stats.where}{picked}")
    for col in ("layout (one per model and shape; canonical: per model)", "objects", "bytes", "oldest", "newest"):
        table.add_column(col, justify="right" if col in ("objects", "bytes") else "left")
    rows = [*sorted(stats.groups.items()), *(("node " + n, g) for n, g in sorted(stats.nodes.items()))]
    for name, group in rows:
        table.add_row(name, str(group.objects), str(group.bytes), _when(group.oldest), _when(group.newest))
    t = stats.total
    table.add_row("total", str(t.objects), str(t.bytes), _when(t.oldest), _when(t.newest), style="bold")
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    formats = ", ".join(f"{_FORMATS.get(n, n)}: {g.objects}" for n, g in sorted(stats.formats.items()))
    console.print(f"kvdi objects by format: {formats or 'none'}")
    console.print(
        f"other entries (not kvdi objects, left alone): {stats.other}; foreign entries under object names "
        f"(no kvdi frame or section, left alone): {stats.foreign}, of them odd (no plain object): {stats.odd}"
    )
    console.print(f"server: {json.dumps(stats.server)}")
    console.print(f"settings: {json.dumps(info['settings'])}")
    print(
        f"{stats.kind} at {stats.where}: {t.objects} objects, {_mib(t.bytes)} in {len(stats.groups)} layouts"
        f"{picked}; {stats.foreign} foreign entries"
    )
    return 0


def cmd_store_verify(args: argparse.Namespace, _rest: list[str]) -> int:
    from kvdi.admin import verify_store
    from kvdi.connectors.store.integrity import frame_key

    selection = _selection(args)
    with _opened(args) as (admin, settings), _progress("verify") as progress:
        report = verify_store(admin, frame_key(settings), drop=args.drop, progress=progress, selection=selection)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        for bad in report.bad:
            what = bad.reason if bad.format == "per_rank" else f"{bad.format} section, {bad.reason}"
            print(f"bad: {bad.group}/{bad.name} ({what}){' dropped' if bad.dropped else ''}")
        for foreign in report.foreign:
            print(f"foreign: {foreign.group}/{foreign.name} ({foreign.why}), left alone")
        print(
            f"{report.kind} at {report.where}: {report.checked} objects checked{_by_format(report.formats)}, "
            f"{report.good} good, "
            f"{len(report.bad)} bad{' (dropped)' if args.drop and report.bad else ''}, "
            f"{len(report.foreign)} foreign (left alone) in {report.seconds:.2f} s"
        )
    return EXIT_BAD_OBJECTS if report.bad else 0


def _by_format(formats: dict[str, int]) -> str:
    """`` (canonical 8, per_rank 40)`` when the store holds canonical sections, else "" (as before them)."""
    if set(formats) <= {"per_rank"}:
        return ""
    return " (" + ", ".join(f"{name} {n}" for name, n in sorted(formats.items())) + ")"


def cmd_store_clear(args: argparse.Namespace, _rest: list[str]) -> int:
    from kvdi.admin import clear_store, store_stats

    selection = _selection(args)
    dry_run = args.dry_run or (selection.filtered and not args.yes)  # a filter is easy to get wrong: look first
    with _opened(args) as (admin, _settings):
        if not args.yes and not dry_run:
            count = store_stats(admin).total.objects
            if not sys.stdin.isatty():
                raise ConfigError(f"kvdi store clear: would remove {count} objects from {admin.where}; add --yes")
            answer = input(f"remove all {count} objects from {admin.kind} at {admin.where}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print("nothing removed")
                return 0
        with _progress("clear") as progress:
            report = clear_store(admin, progress, dry_run=dry_run, selection=selection)
    if args.json:
        print(json.dumps(report.as_dict()))
        return 0
    if dry_run:
        for obj in report.removed:
            print(f"would remove: {obj.group}/{obj.name} ({obj.size} B)")
    done = "would remove" if dry_run else "removed"
    picked = f" ({selection.describe()})" if selection.filtered else ""
    hint = "; add --yes to remove them" if dry_run and not args.dry_run else ""
    print(
        f"{done} {len(report.removed)} objects{_by_format(report.formats)}{picked} from {admin.kind} at {admin.where}; "
        f"{len(report.foreign)} foreign entries left alone{hint}"
    )
    return 0


__all__ = ["add_store_parser"]
