"""A :class:`~kvdi.connectors.store.BlockStore` that keeps canonical sections behind the per-rank frame interface.

The store halves keep framing, verifying and copying per-rank frames of their layout; this wrapper,
put between them and a backend (``KVDI_SHARED_STORAGE__FORMAT=canonical``), turns each frame written
into the canonical sections this rank writes (:mod:`.canonical_io`: replicated heads by one rank
only), and each block read into a per-rank frame assembled from the sections this rank needs, each
verified first. A block is there only when every section it needs is present and valid; anything
else is a miss (``None``), counted by reason in :attr:`CanonicalBlockStore.misses`.

Which part of the model this process holds comes from its layout: a model id ending in
``#canonical`` is the whole model; ``#canonical:L{start}+{count}/{layers}:T{rank}/{size}:H{heads}``
(:func:`part_tag`, made by :class:`~kvdi.integrations.vllm.parallel.RankSlice`) is one TP/PP rank's
share of a model with ``layers`` layers and ``heads`` KV heads. A layout with neither is the whole model.
A hybrid model's attention group (``layout.group``) is sectioned as a model of the group's layers, its
fingerprint naming the group; state-page groups are refused (:func:`refuse_group`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvdi.connectors.store.bytecopy import scatter
from kvdi.connectors.store.canonical import Geometry, RankPart, write_plan
from kvdi.connectors.store.canonical_convert import unpack_block
from kvdi.connectors.store.canonical_io import CanonicalRank
from kvdi.connectors.store.canonical_pack import every_pack, frame_bytes, max_pack_bytes
from kvdi.connectors.store.framing import HEADER_SIZE as FRAME_HEADER
from kvdi.connectors.store.framing import Buffer, FrameKey, frame_header
from kvdi.connectors.store.protocol import prefers_async_load
from kvdi.errors import ConfigError

if TYPE_CHECKING:
    from kvdi.connectors.store.protocol import BlockStore
    from kvdi.layout import KVCacheSpec

TAG = "#canonical"
HOT_BYTES = 1 << 20
"""Blocks read, verified and converted together (:meth:`CanonicalBlockStore.place_many`): about half an L2 cache."""
_PART = re.compile(r"#canonical(?::L(\d+)\+(\d+)/(\d+):T(\d+)/(\d+):H(\d+))?$")


def part_tag(layer_start: int, layer_count: int, num_layers: int, tp_rank: int, tp_size: int, num_kv_heads: int) -> str:
    """The model-id suffix naming one rank's share (just :data:`TAG` when the share is the whole model)."""
    if layer_count == num_layers and tp_size == 1:
        return TAG
    return f"{TAG}:L{layer_start}+{layer_count}/{num_layers}:T{tp_rank}/{tp_size}:H{num_kv_heads}"


def refuse_group(layout: KVCacheSpec) -> None:
    """Raise ConfigError, in one line naming the group, for a KV cache group canonical sections cannot hold:
    state pages (Mamba, linear attention: no KV heads to cut) and a pipeline-parallel stage's share of a group
    (which of the group's layers a stage holds is not in its layout)."""
    if layout.page_bytes:
        raise ConfigError(
            f"format=canonical (KVDI_SHARED_STORAGE__FORMAT, KVDI_REDIS__FORMAT, KVDI_S3__FORMAT) cannot store KV "
            f"cache group {layout.group!r}: its Mamba / linear-attention state pages have no KV heads to section; "
            "use format per_rank for this model"
        )
    found = _PART.search(layout.model_id)
    if layout.group and found is not None and found.group(1) is not None and found.group(2) != found.group(3):
        raise ConfigError(
            f"format=canonical cannot store KV cache group {layout.group!r} of a pipeline-parallel stage (layers "
            f"{found.group(1)}+{found.group(2)} of {found.group(3)}); use format per_rank, or pipeline_parallel_size=1"
        )


def refuse_compression(option: str, compression: str, compressor: object | None) -> None:
    """Raise ConfigError, in one line naming ``option`` (``KVDI_REDIS``, ``KVDI_S3``), for a store of canonical
    sections with a ``compressor`` (set from ``compression``): sections are stored uncompressed."""
    if compressor is not None:
        raise ConfigError(
            f"{option}__COMPRESSION={compression!r} with {option}__FORMAT=canonical: canonical sections "
            "are stored uncompressed; set compression none or format per_rank"
        )


def geometry_of(layout: KVCacheSpec, section_layers: int = 0, section_heads: int = 1) -> tuple[Geometry, RankPart]:
    """The model's :class:`Geometry` and this process's :class:`RankPart`, read from ``layout`` (see above).

    A hybrid model's attention group (``layout.group`` set, no ``page_bytes``) is sectioned like a model whose
    layers are the group's: the geometry's model id names the group (kind, window, block size, layers), so
    its fingerprint never lets one group's sections load into another's. Raises ConfigError for a group of
    state pages (Mamba, linear attention: no KV heads to section) and for a PP stage's share of a group."""
    refuse_group(layout)
    return _grid_of(layout, section_layers, section_heads)


def _grid_of(layout: KVCacheSpec, section_layers: int, section_heads: int) -> tuple[Geometry, RankPart]:
    """:func:`geometry_of` for a layout already past :func:`refuse_group`."""
    found = _PART.search(layout.model_id)
    model_id = layout.model_id[: found.start()] if found else layout.model_id
    if layout.group:
        model_id = f"{model_id}|group={layout.group}"
    if found is None or found.group(1) is None:
        g = Geometry(
            model_id, layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype,
            section_layers=section_layers, section_heads=section_heads,
        )  # fmt: skip
        return g, RankPart.of(g)
    start, count, layers, rank, size, heads = (int(v) for v in found.groups())
    if layout.group:  # a group's layers: all of the group's (TP shares them; a PP stage was refused)
        start, count, layers = 0, layout.num_layers, layout.num_layers
    g = Geometry(
        model_id, layers, heads, layout.head_dim, layout.block_size, layout.dtype, section_layers, section_heads
    )
    part = RankPart.of(g, size, rank, (start, count))
    if (part.layer_count, part.head_count) != (layout.num_layers, layout.num_kv_heads):
        raise ValueError(
            f"layout {layout.model_id!r} holds {layout.num_layers} layers x {layout.num_kv_heads} KV heads, "
            f"its canonical tag says {part.layer_count} x {part.head_count}"
        )
    return g, part


def canonical_object_bytes(
    layout: KVCacheSpec, grid: tuple[int, int] = (0, 1), option: str = "KVDI_SHARED_STORAGE"
) -> int:
    """The size of the largest canonical object of ``layout``'s model: a pack of every KV head (a TP=1 writer's).

    Raises ConfigError, in one line, for a grid that does not divide the model or this rank's share."""
    refuse_group(layout)  # its own line, before the grid's
    try:
        geometry, part = _grid_of(layout, *grid)
        write_plan(geometry, part)
    except ValueError as exc:
        raise ConfigError(f"{option}__SECTION_LAYERS={grid[0]} / __SECTION_HEADS={grid[1]}: {exc}") from None
    return max_pack_bytes(geometry)


class CanonicalBlockStore:
    """Per-rank frames in, canonical sections out (and back); see the module docstring."""

    reads_frame_headers = False  # put_many frames sections itself: BlockWriter passes b"" for a frame's header

    def __init__(
        self, inner: BlockStore, layout: KVCacheSpec, key: FrameKey | None = None, grid: tuple[int, int] = (0, 1)
    ) -> None:
        geometry, part = geometry_of(layout, *grid)
        self.inner = inner
        self.rank = CanonicalRank(inner, geometry, part, layout.block_order, key)
        self.hit_source = getattr(inner, "hit_source", "external_unspecified")
        self._fingerprint = layout.fingerprint()
        self._key = key
        self._layers = layout.num_layers
        self._layer_bytes = layout.layer_block_bytes
        self._block_bytes = layout.block_bytes
        self._layout_order = layout.block_order

    def direct_frame_order(self) -> str:
        """:class:`~.staged_order.FrameOrderStore`: the block order whose frames this rank's sections are runs of
        (written from and read into as they are): the layout's where it is, else ``hnc`` where that is (one-head
        sections; a device cache converts into it on the device), else the layout's (converted on the host)."""
        if self.rank.direct(self._layout_order) or not self.rank.direct("hnc"):
            return self._layout_order
        return "hnc"

    def use_frame_order(self, order: str) -> None:
        """:class:`~.staged_order.FrameOrderStore`: the frames put, got and placed from now on are in block
        ``order`` (told at registration; frames built by :meth:`get_many` keep the layout's fingerprint: they
        reach only this process's worker half, which converts them back on the device)."""
        self.rank.reorder(order)

    @property
    def misses(self) -> Counter[str]:
        """Sections that were not loaded, by reason (``absent``, ``checksum``, ``old_format``, ...)."""
        return self.rank.misses

    @property
    def saved_block_bytes(self) -> int:
        """The payload bytes this rank writes a block (its sections'): what the worker half counts in
        ``saved_bytes``, 0 for a rank holding only replicas another rank writes (not its layout's block)."""
        return sum(self.rank.geometry.section_bytes(s) for s in self.rank.writes)

    @property
    def object_bytes(self) -> int:
        """The size of the largest stored object (a pack of every KV head; packs of fewer heads are smaller)."""
        return max_pack_bytes(self.rank.geometry)

    def parts(self) -> list[BlockStore]:
        """:class:`~kvdi.connectors.store.CompositeStore`: the wrapped backend (hit source, health, events)."""
        return [self.inner]

    @property
    def prefers_async_load(self) -> bool:
        """The wrapped store's (:func:`~kvdi.connectors.store.prefers_async_load`): S3 and Redis load beside compute."""
        return prefers_async_load(self.inner)

    def prefetch(self, keys: Sequence[bytes]) -> bool:
        """:class:`~kvdi.connectors.store.PrefetchStore`: read ahead the sections this rank needs of ``keys``
        where the wrapped store can (S3: ranged reads in flight); False where it cannot (a hint, never raises)."""
        ahead, ranges = getattr(self.inner, "prefetch", None), getattr(self.inner, "prefetch_ranges", None)
        if not callable(ahead) or not keys:
            return False
        try:
            plan, frame = self.rank.plans[self.rank.hint], frame_bytes(self.rank.geometry)
            if callable(ranges):  # S3: only this rank's sections of each pack, as the reads will ask for them
                return bool(ranges([(s.pack.key(k), s.offset, s.count * frame) for k in keys for s in plan]))
            return bool(ahead([s.pack.key(k) for k in keys for s in plan]))
        except Exception:
            return False

    def count_prefix(self, keys: Sequence[bytes]) -> int:
        return self.rank.count_prefix(keys)

    def _layers_of(self, pieces: Sequence[Buffer]) -> list[Buffer]:
        """A frame's payload pieces (after its header) as one buffer per layer (joined when not per layer)."""
        payload = pieces[1:]
        layers = self._split([memoryview(p) for p in payload])  # per layer already, or a staged row: no copy
        if layers is not None:
            return list(layers)
        flat = memoryview(b"".join(payload))
        if flat.nbytes != self._block_bytes:
            raise ValueError(f"a frame of {flat.nbytes} B of payload, this layout's block has {self._block_bytes} B")
        lb = self._layer_bytes
        return [flat[i * lb : (i + 1) * lb] for i in range(self._layers)]

    def put_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> int:
        """Write this rank's packs of each framed block; return the blocks whose packs were all written."""
        if not items:
            return 0
        if not self.rank.writes:  # a rank holding only replicas another rank writes: nothing to do
            return len(items)
        written = self.rank.save([(key, self._layers_of(pieces)) for key, pieces in items])
        return written // len(self.rank.packs)

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """Each block as a per-rank frame assembled from its verified sections; None where any is missing or bad."""
        out: list[Buffer | None] = []
        lb, rank = self._layer_bytes, self.rank
        for key, payloads in zip(keys, rank.fetch_many(keys), strict=True):
            if payloads is None:
                out.append(None)
                continue
            frame = bytearray(FRAME_HEADER + self._block_bytes)
            block = memoryview(frame)[FRAME_HEADER:]
            layers = [block[i * lb : (i + 1) * lb] for i in range(self._layers)]
            unpack_block(rank.geometry, rank.part, layers, rank.order, rank.reads, payloads)
            frame[:FRAME_HEADER] = frame_header(self._fingerprint, block, self._key, name=key)
            rank.loaded_blocks += 1
            out.append(frame)
        return out

    def get_into_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        """:class:`~kvdi.connectors.store.ReadIntoStore`: each block's per-rank frame built straight into its
        pieces (a header, then the block, e.g. the cache's layer views): verified sections unpacked in place,
        then the header written; None where any section is missing or bad (pieces untouched then)."""
        frame = FRAME_HEADER + self._block_bytes
        shaped = [len(p) > 1 and p[0].nbytes == FRAME_HEADER and sum(x.nbytes for x in p) == frame for _, p in items]
        payloads = [(key, pieces[1:] if ok else ()) for (key, pieces), ok in zip(items, shaped, strict=True)]
        placed = self._place(payloads, direct=False)  # pieces untouched unless all is valid
        for (key, pieces), size, ok in zip(items, placed, shaped, strict=True):
            if size is not None and ok:  # the frame header too, for callers that check frames
                pieces[0][:] = frame_header(self._fingerprint, pieces[1:], self._key, name=key)
        return [None if size is None else frame for size in placed]

    def place_many(self, items: Sequence[tuple[bytes, Sequence[memoryview]]]) -> list[int | None]:
        """Each block's payload (no frame header) placed into its pieces (e.g. the cache's layer views) from its
        sections, each byte verified once: the store worker half checks nothing after
        (:func:`~kvdi.connectors.store.reads.read_chunk`). Returns the payload bytes placed, None where any
        section is missing or bad; pieces of another size get nothing placed.

        Where the sections are runs of the layers (:attr:`.CanonicalRank.read_runs`) they are read straight
        into them and verified there, as a per-rank frame read into the cache is: a block that is then a miss
        may hold bad bytes, never offered (vLLM recomputes it). Else they are read and verified in a staging
        buffer and converted into the pieces only when valid."""
        return self._place(items, direct=True)

    def _place(self, items: Sequence[tuple[bytes, Sequence[memoryview]]], direct: bool) -> list[int | None]:
        rank, size = self.rank, self._block_bytes
        if direct and rank.read_runs is not None:
            layered = [self._split(p) for _, p in items]  # a staged row (one piece) as its layers, no copy
            if all(p is not None for p in layered):
                loaded = rank.load_direct([(key, p or ()) for (key, _), p in zip(items, layered, strict=True)])
                rank.loaded_blocks += sum(loaded)
                return [size if ok else None for ok in loaded]
        out: list[int | None] = []
        step = max(1, HOT_BYTES // size)  # read, verify and convert a few blocks at a time, while in the CPU cache
        for at in range(0, len(items), step):
            chunk = items[at : at + step]  # the staging views of one fetch are valid until the next
            for (_, payload), payloads in zip(chunk, rank.fetch_many([key for key, _ in chunk]), strict=True):
                if payloads is None:
                    out.append(None)
                    continue
                if sum(p.nbytes for p in payload) != size:
                    out.append(size)  # not this block's shape: the caller reads nothing into them
                    continue
                layers = self._as_layers(payload)
                unpack_block(rank.geometry, rank.part, layers, rank.order, rank.reads, payloads)
                if layers is not payload:
                    scatter(b"".join(layers), payload)
                rank.loaded_blocks += 1
                out.append(size)
        return out

    def _per_layer(self, payload: Sequence[memoryview]) -> bool:
        return len(payload) == self._layers and all(p.nbytes == self._layer_bytes for p in payload)

    def _split(self, payload: Sequence[memoryview]) -> Sequence[memoryview] | None:
        """``payload`` as one view per layer: itself, or a contiguous block's (a staged row) slices; else None."""
        if self._per_layer(payload):
            return payload
        if len(payload) != 1 or payload[0].nbytes != self._block_bytes or not payload[0].c_contiguous:
            return None
        flat, lb = payload[0].cast("B"), self._layer_bytes
        return [flat[i * lb : (i + 1) * lb] for i in range(self._layers)]

    def _as_layers(self, payload: Sequence[memoryview]) -> Sequence[memoryview]:
        """``payload`` itself when it is one view per layer, else fresh per-layer buffers to scatter after."""
        if self._per_layer(payload):
            return payload
        return [memoryview(bytearray(self._layer_bytes)) for _ in range(self._layers)]

    def discard(self, key: bytes) -> None:
        """Drop every pack of block ``key`` (of every size, not only this rank's: a bad block goes for all)."""
        for pack in every_pack(self.rank.geometry):
            self.inner.discard(pack.key(key))

    @property
    def stored_bytes(self) -> int | None:
        """The wrapped store's gauge (``vllm:kvdi_store_bytes``), when it has one."""
        value = getattr(self.inner, "stored_bytes", None)
        return value if isinstance(value, int) else None

    def check(self) -> str:
        """The wrapped store's health line (``kvdi check``), marked canonical."""
        probe = getattr(self.inner, "check", None)
        return f"canonical sections; {probe()}" if callable(probe) else "canonical sections"

    def close(self) -> None:
        self.inner.close()


__all__ = [
    "TAG",
    "CanonicalBlockStore",
    "canonical_object_bytes",
    "geometry_of",
    "part_tag",
    "refuse_compression",
    "refuse_group",
]
