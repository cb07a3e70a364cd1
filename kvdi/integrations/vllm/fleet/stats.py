"""kvdi's counters for vLLM: cheap per-step deltas and private, atomically replaced stats files (vLLM-free).

:class:`StatsReporter` reads a half's :class:`~kvdi.connectors.base.ConnectorStats` as one
tuple per step and builds nothing when nothing changed, so an idle step costs one
attribute fetch per counter and a tuple comparison.
:func:`write_stats_file` publishes cumulative counters under ``kvdi_stats_dir`` the way
kvdi's stores write objects: owner-only, random ``O_EXCL|O_NOFOLLOW`` temp names, an
atomic rename, no symlink followed in the directory. :class:`StatsFileWriter` rewrites it
on each step whose counters moved, on the caller's thread, so the file is current when a process is killed
without running its exit handlers (a writer thread lost the last counters under ``vllm serve``'s shutdown).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path

from kvdi.connectors.base import ConnectorStats
from kvdi.errors import ConfigError

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM configures only its own logger tree

_FILE_MODE = 0o600
_DIR_MODE = 0o700


def check_engine_id(engine_id: str) -> str:
    """``engine_id`` when it can name a file in the stats directory; ConfigError otherwise."""
    if not engine_id or "/" in engine_id or "\\" in engine_id or "\0" in engine_id or ".." in engine_id:
        raise ConfigError(
            f"kv_transfer_config.engine_id={engine_id!r} cannot name a kvdi stats file: it must be non-empty "
            "and contain no '/', '\\\\', NUL or '..'; set another engine_id or drop kv_connector_extra_config"
            "['kvdi_stats_dir']"
        )
    return engine_id


@dataclasses.dataclass
class AdapterStats:
    """What the vLLM adapter itself counts, beside the half's :class:`ConnectorStats`.

    Scheduler: ``async_load_requests`` (requests vLLM accepted an asynchronous load for: they
    wait in ``WAITING_FOR_REMOTE_KVS``). Worker: ``finished_recving`` / ``finished_sending``
    (requests reported to vLLM through ``get_finished``), ``preempted_flushed`` (preempted
    requests whose queued transfers were finished before their blocks were reused),
    ``async_load_steps`` and ``load_steps_1`` .. ``load_steps_4_or_more`` (engine steps each
    asynchronous load spanned, summed and as a histogram: :mod:`..async_loads`),
    ``idle_load_waits`` / ``idle_load_wait_seconds`` (empty steps that waited for a load:
    :mod:`..pending`). ``prefetch_reported`` / ``prefetch_staged_blocks`` (scheduler: prefetches at
    lookup the worker finished, and the blocks they staged: :mod:`..prefetch`).
    """

    async_load_requests: int = 0
    finished_recving: int = 0
    finished_sending: int = 0
    preempted_flushed: int = 0
    async_load_steps: int = 0
    load_steps_1: int = 0
    load_steps_2: int = 0
    load_steps_3: int = 0
    load_steps_4_or_more: int = 0
    idle_load_waits: int = 0
    idle_load_wait_seconds: float = 0.0
    prefetch_reported: int = 0
    prefetch_staged_blocks: int = 0


class StatsReporter:
    """Deltas of one dataclass of counters since the previous call, built only when a counter moved."""

    def __init__(self, stats: ConnectorStats | AdapterStats) -> None:
        self.stats = stats
        self.names = tuple(f.name for f in dataclasses.fields(stats))
        self._read = attrgetter(*self.names)
        self._reported: tuple[int | float, ...] = self.snapshot()

    def snapshot(self) -> tuple[int | float, ...]:
        """The counters now, in :attr:`names` order."""
        values = self._read(self.stats)
        return values if isinstance(values, tuple) else (values,)

    def delta(self) -> dict[str, int | float] | None:
        """Counters that changed since the last call (name -> increase), or None when none did."""
        now = self.snapshot()
        before = self._reported
        if now == before:
            return None
        self._reported = now
        return {name: new - old for name, new, old in zip(self.names, now, before, strict=True) if new != old}

    def as_dict(self) -> dict[str, int | float]:
        """Cumulative counters by name."""
        return dict(zip(self.names, self.snapshot(), strict=True))


def write_stats_file(
    directory: str | Path, engine_id: str, role: str, name: str, counters: dict[str, int | float]
) -> Path:
    """Cumulative ``counters`` as ``<dir>/<engine_id>-<role>-<pid>.json`` (mode 0600), published atomically.

    The directory is created 0700 when missing and must not be a symlink; the file is
    written under a random temp name opened ``O_CREAT|O_EXCL|O_NOFOLLOW`` relative to the
    directory's descriptor and renamed over the target, so a planted symlink is neither
    followed nor written through. Raises ConfigError for an ``engine_id`` that is not a
    plain file name part, OSError when the directory cannot be used.
    """
    check_engine_id(engine_id)
    path = Path(directory)
    path.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        target = f"{engine_id}-{role}-{os.getpid()}.json"
        tmp = f".{target}.{secrets.token_hex(8)}.tmp"
        payload = json.dumps({"connector": name, "role": role, "engine_id": engine_id, **counters}).encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, _FILE_MODE, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as fh:
                fd = -1
                fh.write(payload)
            os.replace(tmp, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        return path / target
    finally:
        os.close(dir_fd)


class StatsFileWriter:
    """Keeps one stats file (:func:`write_stats_file`) current: :meth:`stale` (a step whose counters moved)
    rewrites it before it returns; :meth:`close` writes the final counters once."""

    def __init__(
        self, directory: str, engine_id: str, role: str, name: str, counters: Callable[[], dict[str, int | float]]
    ) -> None:
        self._args = (directory, engine_id, role, name)
        self._counters = counters
        self._closed = False
        self._failed = False

    def stale(self) -> None:
        """The counters moved: the file is rewritten now."""
        if not self._closed:
            self.write()

    def write(self) -> None:
        """Write the counters now (an error is logged once; the engine never fails on its stats file)."""
        try:
            write_stats_file(*self._args, self._counters())
        except (OSError, ConfigError) as exc:
            if not self._failed:
                self._failed = True
                logger.warning("kvdi: stats file not written under %s: %s", self._args[0], exc)

    def close(self) -> None:
        """Write the final counters (once; later calls do nothing)."""
        if not self._closed:
            self._closed = True
            self.write()
