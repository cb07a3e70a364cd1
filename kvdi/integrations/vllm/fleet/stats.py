"""kvdi's counters for vLLM: cheap per-step deltas and private, atomically replaced stats files (vLLM-free).

:class:`StatsReporter` reads a half's :class:`~kvdi.connectors.base.ConnectorStats` as one
tuple per step and builds nothing when nothing changed, so an idle step costs one
attribute fetch per counter and a tuple comparison.
:func:`write_stats_file` publishes cumulative counters under ``kvdi_stats_dir`` the way
kvdi's stores write objects: owner-only, random ``O_EXCL|O_NOFOLLOW`` temp names, an
atomic rename, no symlink followed in the directory. :class:`StatsFileWriter` keeps it current off the
engine's thread: a step whose counters moved only sets an event; one writer thread (started on the first
such step, so none exists while nothing moves and none at all without ``kvdi_stats_dir``) sleeps on that
event, writes the counters as they are then (every step since its last write in one file), and waits at
least :data:`MIN_WRITE_INTERVAL_S` before the next write: a live engine's file lags its counters by at most
that plus one write. :meth:`StatsFileWriter.close` stops the thread and writes the final counters on the
caller's thread: the connector calls it after kvdi's half drained its queued saves, so the final file counts
them (and at interpreter exit, for an engine that exits without shutting kvdi down).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import threading
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import cast

from kvdi.connectors.base import ConnectorStats
from kvdi.errors import ConfigError

logger = logging.getLogger(f"vllm.{__name__}")  # vLLM configures only its own logger tree

_FILE_MODE = 0o600
MIN_WRITE_INTERVAL_S = 0.25  # the writer thread's rest between two writes: at most 4 files a second
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
        self._reported: object = self._read(stats)  # as read: a tuple, or the value itself for one counter

    def snapshot(self) -> tuple[int | float, ...]:
        """The counters now, in :attr:`names` order."""
        values = self._read(self.stats)
        return values if isinstance(values, tuple) else (values,)

    def delta(self) -> dict[str, int | float] | None:
        """Counters that changed since the last call (name -> increase), or None when none did (one read and one
        comparison, no Python call)."""
        now = self._read(self.stats)
        before = self._reported
        if now == before:
            return None
        self._reported = now
        if not isinstance(now, tuple):
            return {self.names[0]: cast(float, now) - cast(float, before)}
        old = cast(tuple[float, ...], before)
        return {name: new - was for name, new, was in zip(self.names, now, old, strict=True) if new != was}

    def as_dict(self) -> dict[str, int | float]:
        """Cumulative counters by name."""
        return dict(zip(self.names, self.snapshot(), strict=True))


class StepDeltas:
    """The deltas of two :class:`StatsReporter` (kvdi's half and the adapter) in one call: ``(None, None)`` at once
    when no counter of either moved (two reads and two comparisons, no other Python call)."""

    def __init__(self, half: StatsReporter, adapter: StatsReporter) -> None:
        self._half = half
        self._adapter = adapter

    def deltas(self) -> tuple[dict[str, int | float] | None, dict[str, int | float] | None]:
        half, adapter = self._half, self._adapter
        if half._read(half.stats) == half._reported and adapter._read(adapter.stats) == adapter._reported:
            return None, None
        return half.delta(), adapter.delta()


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
    """Keeps one stats file (:func:`write_stats_file`) current from a writer thread: :meth:`stale` (a step whose
    counters moved) wakes it and returns at once; :meth:`close` stops it and writes the final counters once."""

    def __init__(
        self,
        directory: str,
        engine_id: str,
        role: str,
        name: str,
        counters: Callable[[], dict[str, int | float]],
        min_interval_s: float = MIN_WRITE_INTERVAL_S,
    ) -> None:
        self._args = (directory, engine_id, role, name)
        self._counters = counters
        self._min_interval_s = min_interval_s
        self._closed = False
        self._failed = False
        self._moved = threading.Event()  # counters moved since the thread's last write
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self.writes = 0  # files written (by the thread and by close)

    def stale(self) -> None:
        """The counters moved: the writer thread rewrites the file soon (this returns at once)."""
        if self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"kvdi-stats-{self._args[2]}", daemon=True)
            self._thread.start()
            atexit.register(self.close)  # an engine that exits without shutting kvdi down still writes the last
        if not self._moved.is_set():  # already set: the thread writes these steps too (no lock taken)
            self._moved.set()

    def _run(self) -> None:
        while True:
            self._moved.wait()
            if self._closing.is_set():
                return
            self._moved.clear()  # a step that moves the counters from here on is written next time
            self.write()
            if self._closing.wait(self._min_interval_s):  # rest, coalescing the steps meanwhile; close wakes it
                return

    def write(self) -> None:
        """Write the counters now (an error is logged once; the engine never fails on its stats file)."""
        try:
            write_stats_file(*self._args, self._counters())
            self.writes += 1
        except (OSError, ConfigError) as exc:
            if not self._failed:
                self._failed = True
                logger.warning("kvdi: stats file not written under %s: %s", self._args[0], exc)

    def close(self) -> None:
        """Stop the writer thread, then write the final counters on this thread (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._moved.set()
        if self._thread is not None:
            self._thread.join()  # no write of the thread's lands after the final one
            atexit.unregister(self.close)
        self.write()
