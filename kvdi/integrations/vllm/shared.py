"""One kvdi container per vLLM engine id within a process, so co-located connector halves share one backend."""

from __future__ import annotations

import threading
from typing import Any

from dependency_injector import providers

from kvdi.containers import KVTransferContainer, build_kv_container
from kvdi.layout import KVCacheSpec


class SharedContainers:
    """One kvdi container per engine id within a process, so co-located halves share one backend.

    Module-level on purpose: vLLM constructs each role separately and gives the two
    objects no way to reach each other.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[KVTransferContainer, int]] = {}

    def acquire(self, engine_id: str, settings_kwargs: dict[str, Any], layout: KVCacheSpec) -> KVTransferContainer:
        with self._lock:
            entry = self._entries.get(engine_id)
            if entry is None:
                container = build_kv_container(**settings_kwargs)
                container.layout.override(providers.Object(layout))
                entry = (container, 0)
            self._entries[engine_id] = (entry[0], entry[1] + 1)
            return entry[0]

    def release(self, engine_id: str) -> None:
        with self._lock:
            entry = self._entries.get(engine_id)
            if entry is None:
                return
            container, users = entry
            if users > 1:
                self._entries[engine_id] = (container, users - 1)
                return
            del self._entries[engine_id]
        container.shutdown_resources()


SHARED = SharedContainers()
