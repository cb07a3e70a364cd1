"""``kvdi store stats``: kvdi objects and bytes per layout fingerprint (one per model and shape), read by content.

Rows: a per-rank layout by its fingerprint's hex, canonical sections as ``canonical:<fingerprint>``
(one per model and grid, whatever shape wrote them), sections of an older canonical version as
``canonical_v1:<fingerprint>`` (kvdi's, never loaded: a ``version`` miss); :attr:`StoreStats.formats`
sums them per format. Foreign entries (no kvdi header, or a section header of another name) are counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvdi.admin.model import PER_RANK, Progress, StoreAdmin, StoreObject, headed, object_format, selected
from kvdi.admin.sections import group_of

if TYPE_CHECKING:
    from kvdi.admin.select import Selection


@dataclass
class GroupStats:
    objects: int = 0
    bytes: int = 0
    oldest: float | None = None
    newest: float | None = None

    def add(self, obj: StoreObject) -> None:
        self.objects += 1
        self.bytes += obj.size
        if obj.stamp is not None:
            self.oldest = obj.stamp if self.oldest is None else min(self.oldest, obj.stamp)
            self.newest = obj.stamp if self.newest is None else max(self.newest, obj.stamp)

    def as_dict(self) -> dict[str, Any]:
        return {"objects": self.objects, "bytes": self.bytes, "oldest": self.oldest, "newest": self.newest}


@dataclass
class StoreStats:
    """kvdi objects and bytes in total and per layout fingerprint (one per model and shape; ``nodes``: per cluster
    node); ``other``: entries of other names; ``foreign``: entries under an object's name that are no kvdi frame
    (``odd`` of them no plain object at all); ``formats``: kvdi objects per format (``per_rank``, ``canonical``,
    ``canonical_v1``); ``server``: :meth:`StoreAdmin.server_info`."""

    kind: str
    where: str
    total: GroupStats
    groups: dict[str, GroupStats]
    other: int
    odd: int
    foreign: int = 0
    nodes: dict[str, GroupStats] = field(default_factory=dict)
    formats: dict[str, GroupStats] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    selected: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "where": self.where,
            **self.total.as_dict(),
            "other_entries": self.other,
            "odd_entries": self.odd,
            "foreign_entries": self.foreign,
            "layouts": {name: g.as_dict() for name, g in sorted(self.groups.items())},
            "formats": {name: g.as_dict() for name, g in sorted(self.formats.items())},
            **({"nodes": {n: g.as_dict() for n, g in sorted(self.nodes.items())}} if self.nodes else {}),
            "server": self.server,
            "selection": self.selected,
        }


def store_stats(admin: StoreAdmin, selection: Selection | None = None, progress: Progress | None = None) -> StoreStats:
    """Count every (selected) kvdi object of the store (its header read to tell), in total, per layout and per
    format (per-rank frames, canonical sections, sections of another canonical version)."""
    from kvdi.admin.select import layout_of

    total = GroupStats()
    groups: dict[str, GroupStats] = {}
    nodes: dict[str, GroupStats] = {}
    formats: dict[str, GroupStats] = {}
    odd = foreign = 0
    listing = list(admin.objects())
    for done, (obj, head) in enumerate(headed(admin, listing), 1):
        if progress is not None:
            progress(done, len(listing))
        if head is None:
            continue  # vanished
        fmt = object_format(obj, head)
        if fmt is None:
            foreign += 1
            odd += obj.odd is not None
            continue
        if not selected(selection, obj, head):
            continue
        total.add(obj)
        formats.setdefault(fmt, GroupStats()).add(obj)
        groups.setdefault(layout_of(head) if fmt == PER_RANK else group_of(fmt, head), GroupStats()).add(obj)
        if admin.kind == "redis cluster":
            nodes.setdefault(obj.group, GroupStats()).add(obj)
    picked = selection.describe() if selection is not None else ""
    stats = StoreStats(admin.kind, admin.where, total, groups, admin.other_entries(), odd, foreign, nodes, formats)
    stats.server, stats.selected = admin.server_info(), picked
    return stats


__all__ = ["GroupStats", "StoreStats", "store_stats"]
