"""The load deadline's running estimates (:mod:`.deadline`): a store's round trip and throughput, an engine's prefill
rate, each from kvdi's own measurements.

The prefill rate and a step's fixed part (a decode step's time, left out of the rate) are exponentially weighted
moving averages (:class:`Ewma`); the throughput the median of recent
samples (:class:`Rates`: a prefetch delayed by a jittered round trip is a slow sample an average believed, and the
next lookups were skipped even with the store 0 ms away). The round trip is a
robust estimate (:class:`RoundTrips`) because the rule acts on it at once (a lookup skipped, a hit refused): a store
with heavy jitter answers one round trip in ten several times slower than usual, and an average that believes such a
sample (the previous rule weighed a rise 0.6) turns a jittered store into a "slow" one for the next requests, whose
lookups and hits would have paid off. So:

- the estimate is the median of the last :data:`RTT_WINDOW` samples: a lone outlier does not move it;
- a rise is believed at once only from an overrun (:meth:`RoundTrips.at_least`: a wait ran that long and had not
  answered; the estimate stays at least that until the store answers faster, a fall believed at once), and from
  samples when it is sustained: :data:`SHIFT_SAMPLES` samples in a row beyond :data:`SHIFT` x the median of the ones
  before them (a store that moved, slower or faster) restart the window from them;
- a deadline (how long a lookup or a load may run before it is abandoned) is measured from the slow end of recent
  round trips (:attr:`RoundTrips.tail`: the slowest of the last :data:`TAIL_WINDOW`, kept when the median's
  window restarts), not the median: a jittered store's usual outlier is not an overrun;
- the prober (:meth:`.deadline.DeadlineRule.probe`) asks again at once while its sample is beyond :data:`SHIFT` x
  the estimate (:attr:`RoundTrips.unsettled`), so an idle engine believes a store that moved within a few round
  trips, and a jittered probe's outlier is outvoted by the next ones.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

ALPHA = 0.2
"""Weight of a new sample in the prefill estimate."""

RTT_WINDOW = 9
"""Round-trip samples the median is taken over."""

TAIL_WINDOW = 32
"""Round-trip samples the slow end (:attr:`RoundTrips.tail`, a deadline's measure: the slowest of them) is taken over:
enough that a jittered store's usual outliers (one round trip in five, say) are in it whatever the last few were."""

LOAD_WINDOW = 9
"""Throughput samples the load throughput's median is taken over."""

SHIFT = 2.0
"""A round-trip sample beyond this factor of the estimate (either way) is an outlier unless it persists."""

SHIFT_SAMPLES = 3
"""Outliers in a row, all on the same side, that make a shift: the window restarts from them."""

MIN_STEP_TOKENS = 32
"""Engine steps that scheduled fewer tokens (decode steps) tell little of the prefill rate: not sampled."""

MAX_STEP_S = 30.0
"""A gap between steps longer than this is an idle engine, not a step: not sampled."""

RTT_BOUNDS = (1e-6, 600.0)
THROUGHPUT_BOUNDS = (1e3, 1e12)
PREFILL_BOUNDS = (10.0, 1e8)


@dataclass
class Ewma:
    """A running estimate: each sample clamped to ``[low, high]``, then weighted ``alpha`` (the first one whole)."""

    low: float
    high: float
    alpha: float = ALPHA
    value: float | None = None
    samples: int = 0

    def add(self, sample: float, replace: bool = False) -> float:
        """Fold ``sample`` in (``replace``: the estimate becomes the sample); the new estimate."""
        clamped = min(max(float(sample), self.low), self.high)
        old = self.value
        self.value = clamped if old is None or replace else old + self.alpha * (clamped - old)
        self.samples += 1
        return self.value


class Rates:
    """A store's load throughput: the median of the last :data:`LOAD_WINDOW` samples, each clamped to
    ``[low, high]`` (``value`` None until the first). A prefetch whose round trip was one of a jittered store's
    outliers is a slow sample (its extra wait is taken for bytes); an average believed it, and the next lookups'
    whole-hit loads looked dearer than recomputing them (skipped even at 0 ms); a median does not move for it."""

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high
        self.recent: tuple[float, ...] = ()
        self.samples = 0

    @property
    def value(self) -> float | None:
        recent = self.recent
        return statistics.median(recent) if recent else None

    def add(self, sample: float, replace: bool = False) -> float:
        """Fold ``sample`` in (``replace``: the estimate becomes the sample); the new estimate."""
        clamped = min(max(float(sample), self.low), self.high)
        self.recent = (clamped,) if replace else (*self.recent, clamped)[-LOAD_WINDOW:]
        self.samples += 1
        value = self.value
        assert value is not None
        return value


class RoundTrips:
    """A store's round trip: the median of recent samples, at least the longest unanswered wait since the store last
    answered faster (see the module's docstring); ``value`` None until a sample or an overrun."""

    def __init__(self, low: float = RTT_BOUNDS[0], high: float = RTT_BOUNDS[1]) -> None:
        self.low, self.high = low, high
        self.recent: tuple[float, ...] = ()  # the window, replaced whole: readers on other threads see one or the other
        self.history: tuple[float, ...] = ()  # the last TAIL_WINDOW samples (the slow end's)
        self.floor: float | None = None  # set by an overrun, cleared by an answer faster than it
        self.samples = 0

    @property
    def value(self) -> float | None:
        recent = self.recent
        median = statistics.median(recent) if recent else None
        if self.floor is None:
            return median
        return self.floor if median is None else max(median, self.floor)

    @property
    def tail(self) -> float | None:
        """The slow end of recent round trips (the slowest of the last :data:`TAIL_WINDOW`), at least the estimate:
        how long a lookup may run on this store, jitter included, without it having turned slow (a deadline's
        measure; a jittered store's outliers are its usual tail, not a stall). A stall's lone answer (a probe that
        waited it out) lifts it for the next samples; what a deadline takes from it is bounded by the cost of
        recomputing (:meth:`.deadline.DeadlineRule.slow_end_s`)."""
        value, history = self.value, self.history
        if value is None or not history:
            return value
        return max(value, max(history))

    @property
    def unsettled(self) -> bool:
        """The newest sample lies beyond :data:`SHIFT` x the estimate: one more sample tells an outlier from a shift."""
        value, recent = self.value, self.recent
        return bool(recent) and value is not None and _beyond(recent[-1], value)

    def add(self, sample: float, replace: bool = False) -> float:
        """Fold ``sample`` in (``replace``: the estimate becomes the sample); the new estimate."""
        clamped = min(max(float(sample), self.low), self.high)
        if replace:
            self.recent, self.history, self.floor = (), (), None
        if self.floor is not None and clamped < self.floor:
            self.floor = None  # the store answered faster than the wait that overran: believed at once
        window = (*self.recent, clamped)[-RTT_WINDOW:]
        history = (*self.history, clamped)[-TAIL_WINDOW:]
        self.samples += 1
        if len(window) > SHIFT_SAMPLES:
            before = statistics.median(window[:-SHIFT_SAMPLES])
            last = window[-SHIFT_SAMPLES:]
            if all(s > SHIFT * before for s in last) or all(s * SHIFT < before for s in last):
                window = last  # sustained: the store moved (its slow end keeps the history: a jittered store shifts)
        self.recent, self.history = window, history
        value = self.value
        assert value is not None
        return value

    def at_least(self, seconds: float) -> None:
        """A call ran ``seconds`` and had not answered: the round trip is at least that until an answer is faster."""
        clamped = min(max(float(seconds), self.low), self.high)
        value = self.value
        if value is None or value < clamped:
            self.floor = clamped


def _beyond(sample: float, value: float) -> bool:
    return sample > SHIFT * value or sample * SHIFT < value


class CostModel:
    """One store's round trip and throughput, and its engine's prefill rate, from kvdi's own measurements."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.rtt = RoundTrips(*RTT_BOUNDS)
        self.throughput = Rates(*THROUGHPUT_BOUNDS)
        self.prefill = Ewma(*PREFILL_BOUNDS)  # tokens/s beyond a step's fixed part (``overhead``, once measured)
        self.overhead = Ewma(0.0, MAX_STEP_S)  # seconds a step costs whatever its tokens: decode steps' time
        self._step_at: float | None = None
        self._step_tokens = 0

    def round_trip(self, seconds: float, replace: bool = False) -> None:
        self.rtt.add(seconds, replace)

    def at_least(self, seconds: float) -> None:
        """A call ran ``seconds`` and had not answered: the round trip is at least that."""
        self.rtt.at_least(seconds)

    def transfer(self, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` took ``seconds`` as a waiting request saw it (its round trip included)."""
        if nbytes > 0 and seconds > 0:
            self.throughput.add(nbytes / max(seconds - (self.rtt.value or 0.0), seconds / 10))

    def step(self, tokens: int) -> None:
        """An engine step scheduled ``tokens`` now: the previous step's time is a sample, of the fixed part of a step
        (a decode step: 1 to :data:`MIN_STEP_TOKENS` tokens) or of the prefill rate beyond it (a prefill step)."""
        now = self.clock()
        gap, n = now - (self._step_at if self._step_at is not None else now), self._step_tokens
        if self._step_at is not None and 0 < gap <= MAX_STEP_S and n > 0:
            if n >= MIN_STEP_TOKENS:
                self.prefill.add(n / max(gap - (self.overhead.value or 0.0), gap / 10))
            else:
                self.overhead.add(gap)
        self._step_at, self._step_tokens = now, tokens

    def recompute_s(self, tokens: int) -> float | None:
        """Seconds to recompute ``tokens`` in a step of their own: the step's fixed part and the tokens at the
        prefill rate (None until the rate is measured; 0 for no tokens). A step's cost is not linear in its tokens:
        on a CPU engine a 512-token step took 170 ms and 2048-token ones 280-570 ms, not 4x; a linear cost
        overstated what a request adds to a step others compute in (the rule's joining tokens)."""
        rate = self.prefill.value
        if rate is None or tokens <= 0:
            return None if rate is None else 0.0
        return (self.overhead.value or 0.0) + tokens / rate

    def load_s(self, nbytes: int, tail: bool = False) -> float | None:
        """Seconds to load ``nbytes``: a round trip (``tail``: at the slow end of recent ones, :attr:`RoundTrips.tail`)
        and the bytes at the throughput; None until both are measured."""
        rtt = self.rtt.tail if tail else self.rtt.value
        if rtt is None or self.throughput.value is None:
            return None
        return rtt + nbytes / self.throughput.value

    def describe(self) -> str:
        def show(v: float | None, scale: float, unit: str) -> str:
            return "?" if v is None else f"{v * scale:.3g} {unit}"

        return (
            f"round trip {show(self.rtt.value, 1e3, 'ms')}, throughput {show(self.throughput.value, 1e-6, 'MB/s')}, "
            f"prefill {show(self.prefill.value, 1, 'tokens/s')}"
        )


__all__ = [
    "LOAD_WINDOW",
    "MAX_STEP_S",
    "MIN_STEP_TOKENS",
    "RTT_WINDOW",
    "SHIFT",
    "SHIFT_SAMPLES",
    "TAIL_WINDOW",
    "CostModel",
    "Ewma",
    "Rates",
    "RoundTrips",
]
