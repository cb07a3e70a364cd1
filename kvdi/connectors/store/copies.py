"""The copies of a :class:`~kvdi.connectors.store.blockio.CacheIO`, ordered against the engine's CUDA stream.

Every copy, gather and scatter goes through :attr:`OrderedCopies.order` (:mod:`kvdi.connectors.streams`)
when the cache is on CUDA (or a recording stand-in in tests), else straight to torch.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvdi.connectors.streams import StreamOrder


class OrderedCopies:
    """One copy, gather or scatter at a time, on the current stream of a CUDA cache (asynchronous)."""

    order: StreamOrder | None

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One copy: asynchronous on the current stream of a CUDA cache (see :meth:`finish`)."""
        if self.order is not None:
            self.order.copy(dst, src)
        else:
            dst.copy_(src, non_blocking=True)

    def _gather(self, out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        if self.order is not None:
            self.order.gather(out, src, index)
        else:
            import torch

            torch.index_select(src, 0, index, out=out)

    def _scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        if self.order is not None:
            self.order.scatter(dst, index, src)
        else:
            dst.index_copy_(0, index, src)

    def fence(self) -> object:
        """On the engine thread, before handing a job to the background: what the job's copies must
        follow (the compute queued so far on the current stream); None for a CPU cache."""
        return self.order.fence() if self.order is not None else None

    def on_side_stream(self, fence: object) -> contextlib.AbstractContextManager[object]:
        """Background jobs run their copies inside this: on the side stream, after ``fence`` only."""
        return self.order.side(fence) if self.order is not None else contextlib.nullcontext()


__all__ = ["OrderedCopies"]
