"""Packs: the one object a writer rank stores per block and layer section (docs/stored-format.md).

A pack holds the grid sections one writer rank writes of one block's layer section (its heads,
one or more sections of ``section_heads``), each framed as a lone section is (128-byte header,
then the payload), back to back in head order, every header's name field the pack's key. So any
contiguous head range of a pack is one contiguous byte range of it: a reader of any shape reads
just its heads' sections with one bounded range read (``pread``, ``GETRANGE``, a ranged GET) and
verifies each on its own. A pack's key names the block, its layers and its heads (:meth:`Section.key
<.canonical.Section.key>` of the pack's ranges): a TP=1 writer makes one object a block and layer
section, a TP=2 writer two, a replicated head's writer one a head. A reader finds the packs
covering its heads by probing the head counts a writer's pack can have (:func:`pack_sizes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvdi.connectors.store.canonical import HEADER_SIZE, Geometry, Section


@dataclass(frozen=True)
class Span:
    """One range of one pack: sections ``first`` .. ``first + count`` of a plan (consecutive, one layer
    section), lying in ``pack`` back to back from byte ``offset``."""

    pack: Section
    first: int
    count: int
    offset: int


def frame_bytes(geometry: Geometry) -> int:
    """The bytes of one framed grid section inside a pack (header and payload): every section's, the grid is even."""
    g = geometry
    return HEADER_SIZE + g.section_bytes(Section(0, g.layers_per_section, 0, g.section_heads))


def pack_bytes(geometry: Geometry, pack: Section) -> int:
    """The size of the stored object ``pack``."""
    return pack.head_count // geometry.section_heads * frame_bytes(geometry)


def max_pack_bytes(geometry: Geometry) -> int:
    """The largest object a store of ``geometry`` holds (a pack of every head: a TP=1 writer's)."""
    return pack_bytes(geometry, Section(0, geometry.layers_per_section, 0, geometry.num_kv_heads))


def pack_sizes(geometry: Geometry) -> list[int]:
    """The head counts a pack may have, largest first: a writer's heads (``num_kv_heads / tp`` for a TP size
    dividing them, 1 for a replicated head) that are whole sections, i.e. the divisors of ``num_kv_heads``
    that ``section_heads`` divides."""
    heads, per = geometry.num_kv_heads, geometry.section_heads
    return [d for d in range(heads, 0, -1) if heads % d == 0 and d % per == 0]


def spans(geometry: Geometry, sections: Sequence[Section], heads: int) -> list[Span]:
    """``sections`` (a plan: layer-major, heads ascending) grouped by the pack of ``heads`` heads holding each
    (packs start at multiples of ``heads``), with where they lie in it: one range read each."""
    frame, out, i = frame_bytes(geometry), [], 0
    while i < len(sections):
        s = sections[i]
        start = s.head_start // heads * heads
        j = i + 1
        while j < len(sections) and sections[j].layer_start == s.layer_start and sections[j].head_start < start + heads:
            j += 1
        offset = (s.head_start - start) // geometry.section_heads * frame
        out.append(Span(Section(s.layer_start, s.layer_count, start, heads), i, j - i, offset))
        i = j
    return out


def every_pack(geometry: Geometry) -> list[Section]:
    """Every pack a block may be stored as, of every size (what dropping a whole block removes)."""
    ls = geometry.layers_per_section
    return [
        Section(lo, ls, start, d)
        for d in pack_sizes(geometry)
        for lo in range(0, geometry.num_layers, ls)
        for start in range(0, geometry.num_kv_heads, d)
    ]


__all__ = ["Span", "every_pack", "frame_bytes", "max_pack_bytes", "pack_bytes", "pack_sizes", "spans"]
