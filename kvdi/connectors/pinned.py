"""Host memory of exactly the size asked for, page-locked for CUDA copies when asked (``cpu_offload``'s pool).

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds a
request up to a power of two (a 1.2 GiB pool would lock 2 GiB) and keeps the memory cached after the
tensor is gone. :class:`HostRegion` instead maps exactly ``nbytes`` of anonymous memory and, when
``pin`` is on, registers exactly that range with the CUDA driver (``cudaHostRegister``), so copies
between it and the device are DMA (asynchronous, at the link's speed). :meth:`HostRegion.close`
unregisters the range and unmaps it: the memory goes back to the system then, not at exit.

The CUDA calls go through :class:`HostRegistrar`; :func:`cuda_registrar` is the real one (torch's
``torch.cuda.cudart()``), and a test can hand in a recording one where CUDA is absent.
"""

from __future__ import annotations

import contextlib
import mmap
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch


class HostRegistrar(Protocol):
    """Page-locks a host range for the device and releases it (``cudaHostRegister`` / ``cudaHostUnregister``)."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudartRegistrar:
    """:class:`HostRegistrar` over ``torch.cuda.cudart()``; a CUDA error is a RuntimeError naming the call."""

    def __init__(self) -> None:
        import torch

        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    def register(self, ptr: int, nbytes: int) -> None:
        self._check(self._cudart.cudaHostRegister(ptr, nbytes, 0), f"cudaHostRegister({nbytes} B)")

    def unregister(self, ptr: int) -> None:
        self._check(self._cudart.cudaHostUnregister(ptr), "cudaHostUnregister")

    @staticmethod
    def _check(result: object, call: str) -> None:
        code = int(getattr(result, "value", result))  # type: ignore[call-overload]
        if code != 0:
            raise RuntimeError(f"{call} failed with CUDA error {code} ({result})")


def cuda_registrar() -> HostRegistrar:
    """The real registrar (CUDA must be available)."""
    return CudartRegistrar()


class HostRegion:
    """``nbytes`` of page-aligned anonymous host memory, registered with ``registrar`` (None: pageable).

    :attr:`array` is a writable uint8 numpy view of it; :meth:`tensor` a torch view (pinned once
    registered). Views must be dropped before :meth:`close`; one still held keeps the mapping alive
    (it is unmapped when the last view goes), never a dangling pointer.
    """

    def __init__(self, nbytes: int, registrar: HostRegistrar | None = None, *, huge_pages: bool = False) -> None:
        """``huge_pages``: ask the kernel to back the region with transparent huge pages (``MADV_HUGEPAGE``; a
        hint, ignored where unsupported), as numpy does for its large arrays: fewer TLB misses in long copies."""
        if nbytes < 1:
            raise ValueError(f"a host region needs at least 1 byte, got nbytes={nbytes}")
        self.nbytes = nbytes
        self._map: mmap.mmap | None = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.array: np.ndarray | None = np.frombuffer(self._map, dtype=np.uint8, count=nbytes)
        self.ptr = int(self.array.ctypes.data)
        self._registrar = registrar
        if registrar is not None:
            try:
                registrar.register(self.ptr, nbytes)
            except BaseException:
                self._registrar = None
                self.close()
                raise

    @property
    def pinned(self) -> bool:
        """Whether the range is registered with the device now."""
        return self._registrar is not None

    def tensor(self) -> torch.Tensor:
        """A torch uint8 view of the whole region (no copy)."""
        import torch

        if self.array is None:
            raise RuntimeError("host region is closed")
        return torch.from_numpy(self.array)

    def close(self) -> None:
        """Unregister (when registered) and unmap; idempotent."""
        registrar, self._registrar = self._registrar, None
        try:
            if registrar is not None:
                registrar.unregister(self.ptr)
        finally:
            self.array = None
            mapped, self._map = self._map, None
            if mapped is not None:
                with contextlib.suppress(BufferError):  # a view still held: unmapped when the last one goes
                    mapped.close()


__all__ = ["CudartRegistrar", "HostRegion", "HostRegistrar", "cuda_registrar"]
