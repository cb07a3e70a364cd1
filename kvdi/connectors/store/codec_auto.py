"""``compression=auto``'s rule: compress when the time it saves on the link exceeds the time it costs.

A :class:`LinkRule` keeps running estimates (EWMA, weight :data:`EWMA_WEIGHT` for the newest
measurement) of

* the codec on this store's data: its speed (payload bytes compressed per second, one thread) and
  its ratio (payload / compressed), from every compression the :class:`~.codec.Compressor` times:
  the 64 KiB sample of a large block, or a small block whole;
* the link: bytes written per second by one write request (one S3 ``PutObject``, one Redis
  pipeline, one Redis Cluster ``put_many``), which the store reports after each successful write
  (:meth:`LinkRule.link_sample`).

Each block's writer thread compresses and then sends, so per block of ``raw`` bytes compressing
saves ``raw / link * (1 - 1 / ratio)`` seconds of sending and costs ``raw / codec`` seconds of
compressing: ``auto`` compresses when ``(1 - 1 / ratio) * codec > link``. Before both estimates
exist it decides by the sample alone (the 10 % rule); the 10 % floor always holds (a block whose
sample saves less stays plain whatever the link). The reader's decompression is not counted: zstd
decodes several times faster than it encodes, and a reader that gets fewer bytes saves link time
too. A request's bytes per second undercounts a link whose requests are dominated by latency, so
``auto`` leans to compressing small objects on such links. Decisions are counted
(:attr:`LinkRule.compressed`, :attr:`LinkRule.plain`, :attr:`LinkRule.flips`), and a flip is
logged at debug level with the estimates that made it. While the estimates say it does not pay,
only one block in :data:`RESAMPLE_EVERY` is sampled (to follow the data and the link); the rest are
stored plain at no codec cost.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

EWMA_WEIGHT = 0.2
"""Weight of the newest measurement in each running estimate."""
RESAMPLE_EVERY = 8
"""While the estimates say compressing does not pay, one block in this many is still sampled (the rest skip it)."""


@dataclass(frozen=True)
class Estimates:
    """A snapshot of a :class:`LinkRule`: estimates (None until measured) and decisions so far."""

    codec_bps: float | None
    ratio: float | None
    link_bps: float | None
    compressed: int
    plain: int
    flips: int

    def describe(self) -> str:
        """One line for logs and ``kvdi bench`` notes."""

        def mbs(value: float | None) -> str:
            return "unmeasured" if value is None else f"{value / 1e6:.0f} MB/s"

        ratio = "unmeasured" if self.ratio is None else f"{self.ratio:.2f}x"
        return (
            f"codec {mbs(self.codec_bps)} at {ratio}, link {mbs(self.link_bps)}; "
            f"{self.compressed} compressed, {self.plain} plain, {self.flips} flips"
        )


class LinkRule:
    """The running estimates and the decision of ``auto`` for one store; safe to share across threads."""

    def __init__(self, min_saving: float, weight: float = EWMA_WEIGHT, label: str = "auto") -> None:
        self.min_saving = min_saving
        self.weight = weight
        self.label = label
        self.codec_bps: float | None = None
        self.ratio: float | None = None
        self.link_bps: float | None = None
        self.compressed = 0
        self.plain = 0
        self.flips = 0
        self.samples = 0
        """Compressions timed (codec measurements taken)."""
        self._skipped = 0
        self._last: bool | None = None
        self._lock = threading.Lock()

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def codec_sample(self, raw: int, packed: int, seconds: float) -> None:
        """The codec compressed ``raw`` bytes to ``packed`` in ``seconds``."""
        if raw <= 0 or packed <= 0 or seconds <= 0:
            return
        with self._lock:
            self.samples += 1
            self.codec_bps = self._mix(self.codec_bps, raw / seconds)
            self.ratio = self._mix(self.ratio, raw / packed)

    def link_sample(self, nbytes: int, seconds: float) -> None:
        """One write request sent ``nbytes`` (as stored) in ``seconds``."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self.link_bps = self._mix(self.link_bps, nbytes / seconds)

    def pays(self) -> bool | None:
        """Whether compressing saves more link time than it costs, by the estimates; None before both exist."""
        codec, ratio, link = self.codec_bps, self.ratio, self.link_bps
        if codec is None or ratio is None or link is None:
            return None
        return (1 - 1 / ratio) * codec > link

    def skips_sample(self) -> bool:
        """Whether this block is stored plain without a sample: the estimates say compressing does not pay and
        it is not the one block in :data:`RESAMPLE_EVERY` that keeps them current. Counted as a plain decision."""
        if self.pays() is not False:
            return False
        with self._lock:
            self._skipped += 1
            if self._skipped % RESAMPLE_EVERY == 0:
                return False
        self.decide(False)
        return True

    def decide(self, sample_saves: bool) -> bool:
        """Whether to store this block compressed; ``sample_saves``: its sample saved at least ``min_saving``."""
        pays = self.pays()
        choice = sample_saves and pays is not False
        with self._lock:
            if choice:
                self.compressed += 1
            else:
                self.plain += 1
            flipped = self._last is not None and self._last != choice
            self.flips += flipped
            self._last = choice
        if flipped:
            logger.debug("kvdi %s compression now stores blocks %s: %s", self.label,
                         "compressed" if choice else "plain", self.snapshot().describe())  # fmt: skip
        return choice

    def snapshot(self) -> Estimates:
        with self._lock:
            return Estimates(self.codec_bps, self.ratio, self.link_bps, self.compressed, self.plain, self.flips)


__all__ = ["EWMA_WEIGHT", "RESAMPLE_EVERY", "Estimates", "LinkRule"]
