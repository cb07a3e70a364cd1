"""A device cache's blocks put in a canonical store's block order on the device, so that the host converts nothing.

vLLM's GPU caches hold a layer's block as ``nhc`` (``[N, H, 2D]``, :mod:`kvdi.integrations.vllm.views`):
a KV head's bytes are ``block_size`` runs of it, so canonical sections of one head (the default grid)
would cost a strided host copy of every block each way (:func:`~.canonical_convert.pack_block`,
``unpack_block``). In ``hnc`` (``[H, N, 2D]``) a head is one run: the sections are framed from, and read
straight into, the staged rows. A staged cache (:class:`~.blockio.CacheIO`) already gathers a chunk into
a device scratch whose row ``i`` is block ``i``; when converting, that chunk is permuted
``[n, L, N, H, C] -> [n, L, H, N, C]`` into a second device scratch in one copy before its one copy to the
host (loads: the reverse after the host copy, before the scatters). One device call more a chunk each way,
never one a block or a layer; the second scratch holds a chunk (taken at the first copy, like the first).

When: a staged (device) cache whose layout's order is ``nhc``, and every store its frames reach declares
:class:`FrameOrderStore` (the canonical wrapper, :class:`~.canonical_store.CanonicalBlockStore`) and names
``hnc`` as the order it reads and writes without a host copy (one-head sections). The stores are told once,
at registration (:func:`staged_order`), which order their frames are in. Anything else keeps its frames in
the layout's order, unchanged: a CPU cache, per-rank stores, cpu_offload, p2p, and a composite (``multi``)
with any store that does not declare it (cpu_offload's pool in front of a canonical tier: its per-rank
frames stay in the layout's order, and so do the canonical tier's behind it, converted on the host).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from kvdi.connectors.store.copies import OrderedCopies
from kvdi.connectors.store.protocol import FrameOrderStore, StoreCapabilities

if TYPE_CHECKING:
    import torch

    from kvdi.allocator import Staging
    from kvdi.layout import KVCacheSpec

CONVERTED = ("nhc", "hnc")
"""The one conversion done on the device: a layout's ``nhc`` blocks to a store's ``hnc`` frames (and back)."""


class BlockPermute(NamedTuple):
    """A chunk of staged rows viewed ``[n, layers, a, b, words]``, swapped to ``[n, layers, b, a, words]``."""

    layers: int
    tokens: int
    heads: int
    words: int  # of one head's token (K then V), in ``word`` s
    word: torch.dtype

    @classmethod
    def of(cls, layout: KVCacheSpec) -> BlockPermute:
        """The permutation of ``layout``'s blocks (``nhc``) into ``hnc``, in the widest words a head's token allows."""
        import torch

        from kvdi.layout import DTYPE_BYTES

        run = 2 * layout.head_dim * DTYPE_BYTES[layout.dtype]
        size = next(w for w in (8, 4, 2, 1) if run % w == 0)
        word = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[size]
        return cls(layout.num_layers, layout.block_size, layout.num_kv_heads, run // size, word)

    def swap(self, dst: torch.Tensor, src: torch.Tensor, n: int, to_store: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dst, src)`` of the one copy moving rows ``[:n]`` of ``src`` into ``dst`` swapped: into the store's
        order (``to_store``: ``nhc`` to ``hnc``) or back into the cache's."""
        a, b = (self.tokens, self.heads) if to_store else (self.heads, self.tokens)
        shape = (n, self.layers, a, b, self.words)
        out = dst[:n].view(self.word).view(n, self.layers, b, a, self.words)
        return out, src[:n].view(self.word).view(shape).permute(0, 1, 3, 2, 4)


class ReorderedCopies(OrderedCopies):
    """:class:`OrderedCopies` plus a staged chunk's permutation into the store's block order (module docstring);
    ``reorder`` None (the default): none, the rows go to and come from the host in the layout's order."""

    reorder: BlockPermute | None = None
    _reordered: torch.Tensor | None = None
    chunk: int
    _row_bytes: int
    _buffers: Staging
    _name: str
    _device_at: torch.device

    def _landing(self, rows: torch.Tensor) -> torch.Tensor:
        """Where a chunk's rows go to or come from the host: ``rows`` (the device scratch) or, converting, the
        second scratch (taken at its first use, like the first: never at registration)."""
        if self.reorder is None:
            return rows
        if self._reordered is None:
            made = self._buffers(self.chunk * self._row_bytes, device=self._device_at, owner=f"{self._name}/ordered")
            self._reordered = made.view(self.chunk, self._row_bytes)
        return self._reordered

    def _to_store_order(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """Saves: the gathered rows ``[:n]`` in the store's order (one copy into the second scratch), or ``rows``."""
        if self.reorder is None:
            return rows
        landed = self._landing(rows)
        self._copy(*self.reorder.swap(landed, rows, n, to_store=True))
        return landed

    def _to_cache_order(self, landed: torch.Tensor, rows: torch.Tensor, n: int) -> None:
        """Loads: the rows ``[:n]`` that came from the host (:meth:`_landing`) back in the cache's order, before
        the scatters (one copy; nothing when not converting)."""
        if self.reorder is not None:
            self._copy(*self.reorder.swap(rows, landed, n, to_store=False))

    @property
    def reordered_bytes(self) -> int:
        """Device bytes of the second scratch: 0 unless converting, and until its first use."""
        return 0 if self._reordered is None else self.chunk * self._row_bytes


def _reached(store: object) -> tuple[list[FrameOrderStore], bool]:
    """The :class:`FrameOrderStore` s that ``store``'s frames reach (through composites' parts), and whether every
    store they reach is one."""
    if isinstance(store, FrameOrderStore):
        return [store], True
    parts = StoreCapabilities.of(store).parts
    found = [_reached(p) for p in parts]
    return [s for got, _ in found for s in got], bool(parts) and all(ok for _, ok in found)


def staged_order(store: object, layout: KVCacheSpec | None, staged: bool) -> BlockPermute | None:
    """At registration: the permutation a cache's staged chunks take (None: none), after telling every
    :class:`FrameOrderStore` the frames reach which order they are in (``hnc`` when converting, else the
    layout's: a new registration of a CPU cache undoes an earlier one's conversion)."""
    if layout is None:
        return None
    stores, every = _reached(store)
    convert = staged and every and layout.block_order == CONVERTED[0] and not layout.page_bytes
    convert = convert and all(s.direct_frame_order() == CONVERTED[1] for s in stores)
    for s in stores:
        s.use_frame_order(CONVERTED[1] if convert else layout.block_order)
    return BlockPermute.of(layout) if convert else None


__all__ = ["CONVERTED", "BlockPermute", "FrameOrderStore", "ReorderedCopies", "staged_order"]
