"""A recording stand-in for the CUDA calls of :mod:`kvdi.connectors.streams`, for machines without a GPU.

Inject it as ``StreamOrder(device, RecordingCuda())``: copies run for real on CPU tensors,
and every stream and event call is logged in order (``(what, stream or event, ...)``), so a
test can assert *where* each copy ran and *what* the host waited for. Streams are named:
each thread starts on ``"compute"`` (the stream the engine computes on), new streams are
``"side1"``, ``"side2"``...; events are ``"e1"``, ``"e2"``...
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class FakeStream:
    name: str
    log: list[tuple[Any, ...]]

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))


@dataclass(eq=False)
class FakeEvent:
    name: str
    log: list[tuple[Any, ...]]
    stream: str | None = None
    blocking: bool = False  # a blocking-sync event: a host wait on it sleeps instead of spinning

    def record(self, stream: FakeStream) -> None:
        self.stream = stream.name
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("host_wait", self.name, self.stream))


@dataclass
class RecordingCuda:
    """:class:`~kvdi.connectors.streams.CudaCalls` that records and copies on the CPU."""

    log: list[tuple[Any, ...]] = field(default_factory=list)
    events: list[FakeEvent] = field(default_factory=list)  # every event made, in order
    _streams: int = 0
    _events: int = 0
    _local: threading.local = field(default_factory=threading.local)

    def _current(self) -> FakeStream:
        stream: FakeStream | None = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = FakeStream("compute", self.log)
        return stream

    def current_stream(self, device: Any) -> FakeStream:
        return self._current()

    def new_stream(self, device: Any) -> FakeStream:
        self._streams += 1
        return FakeStream(f"side{self._streams}", self.log)

    def new_event(self, blocking: bool = False) -> FakeEvent:
        self._events += 1
        event = FakeEvent(f"e{self._events}", self.log, blocking=blocking)
        self.events.append(event)
        return event

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[FakeStream]:
        before = self._current()
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = before

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", self._current().name))
        dst.copy_(src)

    def gather(self, out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        self.log.append(("gather", self._current().name))
        import torch

        torch.index_select(src, 0, index, out=out)

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("scatter", self._current().name))
        dst.index_copy_(0, index, src)

    def copies(self) -> int:
        """How many calls that move bytes were logged (copies, gathers, scatters)."""
        return count_copies(self.log)

    def host_waits(self) -> int:
        """How many times the host waited on an event."""
        return count_host_waits(self.log)

    def kinds(self) -> list[str]:
        """The logged calls' kinds, in order."""
        return [entry[0] for entry in self.log]


COPY_KINDS = ("copy", "gather", "scatter")
"""The kinds of logged calls that move bytes."""


def count_copies(log: list[tuple[Any, ...]]) -> int:
    """Calls in ``log`` (a part of :attr:`RecordingCuda.log`) that move bytes."""
    return sum(1 for entry in log if entry[0] in COPY_KINDS)


def count_host_waits(log: list[tuple[Any, ...]]) -> int:
    """Host waits on an event in ``log``."""
    return sum(1 for entry in log if entry[0] == "host_wait")


__all__ = ["COPY_KINDS", "FakeEvent", "FakeStream", "RecordingCuda", "count_copies", "count_host_waits"]
