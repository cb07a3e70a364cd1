"""User-registered store connectors for the real-vLLM tests: kvdi's file store behind a slow path.

Loaded by name through ``kvdi.kv_connector_module_path=slow_store`` (the engine scripts' directory
is on ``sys.path``), the way a user plugs in their own medium. ``slow_storage``: every ``put_many``
waits first, like a store across a slow network, so a finished request's queued saves keep its
blocks held (``delay_free``) for several engine steps: :data:`HOLD_STEPS` scheduler steps when the
engine's scheduler ticks :func:`tick` (``engine_probe.py`` does), or until the engine has been idle
:data:`IDLE_S`, so the hold spans the same steps however slow the machine is; :data:`WRITE_DELAY_S`
seconds when nothing ticks. ``slow_reads``: every
``get_many`` waits :data:`READ_DELAY_S`, like a remote store, so prefetches at lookup stay in flight
for several engine steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvdi.connectors.shared_storage import FileBlockStore
from kvdi.connectors.store.framing import HEADER_SIZE
from kvdi.layout import KVCacheSpec
from kvdi.registry import ConnectorSpec
from kvdi.settings import KvdiSettings
from kvdi.settings.sections import SharedStorageSettings

WRITE_DELAY_S = 1.0
READ_DELAY_S = 0.3
HOLD_STEPS = 64
IDLE_S = 0.5
HOLD_MAX_S = 20.0
_clock = {"steps": 0, "last": 0.0}


def tick() -> None:
    """One scheduler step of the engine in this process (called by ``engine_probe.py``'s scheduler wrapper)."""
    _clock["steps"] += 1
    _clock["last"] = time.monotonic()


def _hold() -> None:
    if not _clock["steps"]:
        time.sleep(WRITE_DELAY_S)
        return
    start, give_up = _clock["steps"], time.monotonic() + HOLD_MAX_S
    while _clock["steps"] < start + HOLD_STEPS and time.monotonic() - _clock["last"] < IDLE_S:
        if time.monotonic() > give_up:
            return
        time.sleep(0.005)


class SlowWrites(FileBlockStore):
    """:class:`FileBlockStore` whose writes wait first (:func:`_hold`)."""

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Any]]]) -> Any:
        _hold()
        return super().put_many(items)


class SlowReads(FileBlockStore):
    """:class:`FileBlockStore` whose reads take :data:`READ_DELAY_S` longer (its lookups do not)."""

    prefers_async_load = True  # remote, as far as kvdi can tell

    def get_many(self, keys: Sequence[bytes]) -> Any:
        time.sleep(READ_DELAY_S)
        return super().get_many(keys)


def _open(cls: type[FileBlockStore], options: SharedStorageSettings, layout: KVCacheSpec) -> Any:
    store = cls(Path(options.path), options.max_bytes, mode=options.mode, object_bytes=HEADER_SIZE + layout.block_bytes)
    store.open()
    return store


def open_slow_store(options: SharedStorageSettings, layout: KVCacheSpec, settings: KvdiSettings) -> SlowWrites:
    del settings
    return _open(SlowWrites, options, layout)  # type: ignore[no-any-return]


def open_slow_reads(options: SharedStorageSettings, layout: KVCacheSpec, settings: KvdiSettings) -> SlowReads:
    del settings
    return _open(SlowReads, options, layout)  # type: ignore[no-any-return]


SLOW_STORAGE = ConnectorSpec(
    "slow_storage",
    "kvdi.connectors.store:StoreSchedulerConnector",
    "kvdi.connectors.store:StoreWorkerConnector",
    backend="slow_store:open_slow_store",
    settings="shared_storage",
    description="shared_storage with slow writes (tests)",
)
SLOW_READS = ConnectorSpec(
    "slow_reads",
    "kvdi.connectors.store:StoreSchedulerConnector",
    "kvdi.connectors.store:StoreWorkerConnector",
    backend="slow_store:open_slow_reads",
    settings="shared_storage",
    description="shared_storage with slow reads (tests)",
)
