"""kvdi's messages and counters in vLLM's own envelope types (imports vLLM).

- :class:`KvdiConnectorMetadata`: scheduler to worker, per step (kvdi's metadata inside); a step that moves
  nothing pickles to a few dozen bytes (:data:`EMPTY_INNER`), whatever the number of running requests;
- :class:`KvdiWorkerMetadata`: worker to scheduler, per step (keys stored / found gone);
- :class:`KvdiConnectorStats`: kvdi counters in vLLM's stats pipeline, summed across workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata as VllmConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvdi.connectors.base import BlockTransferMetadata, KVConnectorMetadata
from kvdi.connectors.p2p.scheduler import P2pTransferMetadata
from kvdi.connectors.store.scheduler import StoreTransferMetadata

# kvdi's metadata of a step that moves nothing, one per kind: inside an envelope it pickles as its index here.
EMPTY_INNER: tuple[KVConnectorMetadata, ...] = (
    StoreTransferMetadata(),
    StoreTransferMetadata(async_save=True),  # transfer.async_save: the store halves' default
    BlockTransferMetadata(),
    P2pTransferMetadata(),
)
_ENVELOPE_DEFAULTS: tuple[object, ...] = (None, (), (), False)


@dataclass
class KvdiWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc,unused-ignore]
    """Worker to scheduler, per step: keys stored and keys found gone (only for a :class:`BlockIndex`), and
    prefetches at lookup that finished, ``(request, leading blocks staged)`` (:mod:`.prefetch`)."""

    stored: tuple[bytes, ...] = ()
    dropped: tuple[bytes, ...] = ()
    prefetched: tuple[tuple[str, int], ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvdiWorkerMetadata:
        if not isinstance(other, KvdiWorkerMetadata):
            return self
        return KvdiWorkerMetadata(
            self.stored + other.stored, self.dropped + other.dropped, self.prefetched + other.prefetched
        )


@dataclass
class KvdiConnectorMetadata(VllmConnectorMetadata):  # type: ignore[misc,unused-ignore]
    """vLLM's metadata envelope around kvdi's per-step metadata (pickled to the workers).

    ``preempted``: the requests vLLM preempted this step (their blocks are reused by this
    step's forward pass); the worker flushes their queued transfers in ``handle_preemptions``.
    ``unheld``: requests vLLM finished while they waited for an asynchronous load
    (:mod:`.async_loads`). ``idle``: the step schedules no tokens (the worker may wait for loads).
    """

    inner: KVConnectorMetadata | None = None
    preempted: tuple[str, ...] = ()
    unheld: tuple[str, ...] = ()
    idle: bool = False

    def __reduce__(self) -> tuple[Any, tuple[object, ...]]:
        """Pickled to the workers every step (vLLM's multiprocess executors): an envelope of :func:`empty_envelope`
        travels as its index alone (no comparison), other fields at their default are left out, and an empty
        inner metadata of :data:`EMPTY_INNER` travels as its index."""
        inner: object = self.inner
        for index, shared in enumerate(_EMPTY_ENVELOPES):
            if self is shared:
                return _envelope, (index,)
        for index, empty in enumerate(EMPTY_INNER):
            if type(inner) is type(empty) and inner.__dict__ == empty.__dict__:
                inner = index
                break
        args = (inner, self.preempted, self.unheld, self.idle)
        n = len(args)
        while n and args[n - 1] == _ENVELOPE_DEFAULTS[n - 1]:
            n -= 1
        return _envelope, args[:n]


def _envelope(
    inner: KVConnectorMetadata | int | None = None,
    preempted: tuple[str, ...] = (),
    unheld: tuple[str, ...] = (),
    idle: bool = False,
) -> KvdiConnectorMetadata:
    """Unpickles :class:`KvdiConnectorMetadata` (``inner`` an int: that empty metadata of :data:`EMPTY_INNER`; alone,
    the shared envelope of :func:`empty_envelope` itself, so the worker knows it at a glance)."""
    if isinstance(inner, int):
        if not (preempted or unheld or idle):
            return _EMPTY_ENVELOPES[inner]
        inner = EMPTY_INNER[inner]
    return KvdiConnectorMetadata(inner, preempted, unheld, idle)


_EMPTY_ENVELOPES = tuple(KvdiConnectorMetadata(inner) for inner in EMPTY_INNER)
EMPTY_ENVELOPE_IDS = frozenset(id(e) for e in _EMPTY_ENVELOPES)  # they live as long as this module


def empty_envelope(inner: KVConnectorMetadata | None) -> KvdiConnectorMetadata | None:
    """The shared envelope of a step that moves nothing with ``inner`` (kvdi's metadata of that step), or None when
    ``inner`` is not empty or of no kind of :data:`EMPTY_INNER`. Nobody changes an envelope once built (vLLM binds
    it, kvdi's worker reads it), so one per kind serves every such step: it is built once, pickles as one small
    int without comparing fields, and the worker sees by identity that the step moves nothing
    (:func:`moves_nothing`)."""
    for index, empty in enumerate(EMPTY_INNER):
        # Fields compared as the instances' dicts: no Python call (a dataclass's __eq__ is one, building tuples).
        if inner is empty or (type(inner) is type(empty) and inner.__dict__ == empty.__dict__):
            return _EMPTY_ENVELOPES[index]
    return None


def moves_nothing(meta: object) -> bool:
    """Whether ``meta`` is one of the shared envelopes of :func:`empty_envelope` (a step that moves nothing)."""
    return id(meta) in EMPTY_ENVELOPE_IDS


@dataclass
class KvdiConnectorStats(KVConnectorStats):  # type: ignore[misc,unused-ignore]
    """kvdi counters in vLLM's stats pipeline: ``data = {connector_name: {counter: value}}``."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvdiConnectorStats:
        merged: dict[str, dict[str, float]] = {name: dict(c) for name, c in self.data.items()}
        for name, counters in (other.data or {}).items():
            into = merged.setdefault(name, {})
            for key, value in counters.items():
                into[key] = into.get(key, 0) + value
        return KvdiConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {f"{name}.{key}": v for name, counters in self.data.items() for key, v in counters.items() if v}

    def is_empty(self) -> bool:
        return not any(value for counters in self.data.values() for value in counters.values())
