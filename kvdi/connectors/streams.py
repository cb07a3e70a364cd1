"""Orders kvdi's copies to and from a CUDA KV cache against the stream the engine computes on.

vLLM computes on a CUDA stream of its own, set per thread (``torch.cuda.set_stream``); a thread
kvdi starts begins on the default stream, which does not order with it. The rules every CUDA
copy of kvdi follows (:class:`StreamOrder`):

- **On the engine thread** (synchronous loads and saves): copies run on the *current* stream, so
  they follow the compute queued before them and the forward queued after them sees them. The
  host waits on the copies' event (:meth:`StreamOrder.mark`, then ``synchronize`` on that event)
  before it reads the bytes or reuses the staging: never a device-wide ``torch.cuda.synchronize``.
- **In the background** (asynchronous loads): the engine thread records a *fence* on its current
  stream when it hands the job over (:meth:`StreamOrder.fence`); the job's copies run on a side
  stream that waits on that fence only (:meth:`StreamOrder.side`), so a block's old owner's queued
  writes land first while later forward passes are not waited for; the host waits on the copies'
  event before the job reports the request, so the step that resumes it reads complete bytes. That
  host wait is on a *blocking-sync* event (``torch.cuda.Event(blocking=True)``): the job's thread
  sleeps in the driver instead of spinning a core the engine thread needs (the engine thread's own
  waits stay spin-waits: they are short and on the step's critical path).
- A CUDA tensor kvdi allocates (p2p's index and staging tensors) is allocated and used on the same
  stream, the current one of the thread that copies; a tensor used on another stream must be
  handed to :meth:`StreamOrder.used_on` (``record_stream``) so the caching allocator does not
  reuse its memory early. ``ProcessGroupNCCL`` records the streams of the tensors it moves itself.

Every call into CUDA goes through :class:`CudaCalls`; :class:`TorchCuda` is the real one and
:class:`kvdi.testing.cuda_recording.RecordingCuda` records the calls where CUDA is absent.
Importing this module imports no torch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class CudaCalls(Protocol):
    """The few CUDA calls kvdi's copies make (streams and events are opaque objects)."""

    def current_stream(self, device: Any) -> Any: ...

    def new_stream(self, device: Any) -> Any: ...

    def new_event(self, blocking: bool = False) -> Any: ...

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def gather(self, out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None: ...

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None: ...


class TorchCuda:
    """:class:`CudaCalls` over ``torch.cuda``."""

    def current_stream(self, device: Any) -> Any:
        import torch

        return torch.cuda.current_stream(device)

    def new_stream(self, device: Any) -> Any:
        import torch

        return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def new_event(self, blocking: bool = False) -> Any:
        import torch

        return torch.cuda.Event(blocking=blocking)  # type: ignore[no-untyped-call]

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        import torch

        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def gather(self, out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        import torch

        torch.index_select(src, 0, index, out=out)

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        dst.index_copy_(0, index, src)


class StreamOrder:
    """The side stream and the events of one CUDA cache's copies (see the module docstring)."""

    def __init__(self, device: Any, cuda: CudaCalls | None = None) -> None:
        self.device = device
        self.cuda: CudaCalls = cuda if cuda is not None else TorchCuda()
        self._side: Any = None
        self._background = threading.local()  # ``on``: this thread runs inside :meth:`side`

    @property
    def side_stream(self) -> Any:
        """The stream background copies run on (created on first use)."""
        if self._side is None:
            self._side = self.cuda.new_stream(self.device)
        return self._side

    def fence(self) -> Any:
        """An event recorded on the calling thread's current stream: everything queued there so far."""
        event = self.cuda.new_event()
        event.record(self.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def side(self, fence: Any) -> Iterator[Any]:
        """Run the body's copies on the side stream, after ``fence`` (None: after nothing queued elsewhere)."""
        stream = self.side_stream
        if fence is not None:
            stream.wait_event(fence)
        before = getattr(self._background, "on", False)
        self._background.on = True
        try:
            with self.cuda.use(stream):
                yield stream
        finally:
            self._background.on = before

    def mark(self) -> Any:
        """An event after the copies queued so far on the current stream (wait on it with ``synchronize``);
        a blocking-sync event inside :meth:`side` (a background thread's host wait sleeps, never spins)."""
        event = self.cuda.new_event(blocking=getattr(self._background, "on", False))
        event.record(self.cuda.current_stream(self.device))
        return event

    def wait(self) -> None:
        """Block the host until the copies queued so far on the current stream are done (not the device)."""
        self.mark().synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One asynchronous copy on the current stream."""
        self.cuda.copy(dst, src)

    def gather(self, out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        """``out[i] = src[index[i]]`` on the current stream (one kernel, whatever the number of rows)."""
        self.cuda.gather(out, src, index)

    def scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[index[i]] = src[i]`` on the current stream (one kernel, whatever the number of rows)."""
        self.cuda.scatter(dst, index, src)

    def used_on(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor`` (a CUDA tensor of the caching allocator) is used on ``stream`` too."""
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)


def order_for(device: Any) -> StreamOrder | None:
    """The :class:`StreamOrder` of a cache on ``device``; None for a CPU cache (nothing to order)."""
    import torch

    where = torch.device(device)
    return StreamOrder(where) if where.type == "cuda" else None


__all__ = ["CudaCalls", "StreamOrder", "TorchCuda", "order_for"]
