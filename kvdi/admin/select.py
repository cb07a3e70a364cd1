"""Which kvdi objects a ``kvdi store`` command acts on: by layout fingerprint and by age.

Every frame's header names the layout it was written for (``KVCacheSpec.fingerprint()``: the
model's weights identity, dtype, layers, heads, block size, group), so a store shared by a
fleet's models is administered per model by that fingerprint, read from each object's content
(never from its name or folder). A canonical section's header holds its fingerprint (model,
dtype, geometry, grid, format version: never the shape) at the same place, so ``--layout``
selects sections alike (given as ``stats`` lists them, ``canonical:<hex>``, or as the hex alone).
Age is the time since the object was last written or used, as the backend tells it (a file's
modification time, which loads refresh under a size cap; a Redis key's idle time); an object
whose age is unknown is never selected by ``--older-than``.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from kvdi.admin.model import StoreObject, is_hex
from kvdi.errors import ConfigError

LAYOUT_AT = slice(8, 24)  # the layout field of a per-rank header and of a canonical one (framing.py, canonical.py)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_LABEL = re.compile(r"^canonical(?:_v\d+)?:")  # a canonical row of ``stats``: its fingerprint follows


def layout_of(head: bytes) -> str:
    """The layout fingerprint (32 hex digits) a frame header names."""
    return head[LAYOUT_AT].hex()


def parse_age(text: str, option: str = "--older-than") -> float:
    """Seconds from ``7d``, ``12h``, ``30m``, ``90s`` or ``3600``; ConfigError naming ``option`` otherwise."""
    match = _AGE.match(text)
    if match is None or float(match[1]) <= 0:
        raise ConfigError(
            f"{option}={text!r}: not an age; give a positive number with an optional unit s, m, h, d or w "
            "(e.g. 7d, 12h, 3600)"
        )
    return float(match[1]) * _UNITS[match[2] or "s"]


def parse_layout(text: str, option: str = "--layout") -> str:
    """A layout fingerprint or a prefix of one (hex, 4 to 32 digits, after ``canonical:`` for a canonical row of
    ``stats``), lowercased; ConfigError otherwise."""
    value = _LABEL.sub("", text.strip().lower())
    if not (4 <= len(value) <= 32 and is_hex(value)):
        raise ConfigError(
            f"{option}={text!r}: not a layout fingerprint; give 4 to 32 hex digits of one (or canonical:<hex>), "
            "as 'kvdi store stats' lists them"
        )
    return value


@dataclass(frozen=True)
class Selection:
    """The objects a command acts on: all of them, or those of one layout and/or older than an age."""

    layout: str = ""
    older_than_s: float | None = None
    now: float = field(default_factory=time.time)

    @property
    def filtered(self) -> bool:
        """Whether this selects fewer than all objects (a destructive command then defaults to a dry run)."""
        return bool(self.layout) or self.older_than_s is not None

    def wants(self, obj: StoreObject, head: bytes) -> bool:
        """Whether the kvdi object ``obj`` (``head``: its frame header) is selected."""
        if self.layout and not layout_of(head).startswith(self.layout):
            return False
        if self.older_than_s is not None:
            return obj.stamp is not None and obj.stamp <= self.now - self.older_than_s
        return True

    def describe(self) -> str:
        """The filter in words, for summary lines ("" when none)."""
        parts = [f"layout {self.layout}"] if self.layout else []
        if self.older_than_s is not None:
            parts.append(f"older than {self.older_than_s:g} s")
        return " and ".join(parts)


ALL = Selection()

__all__ = ["ALL", "LAYOUT_AT", "Selection", "layout_of", "parse_age", "parse_layout"]
