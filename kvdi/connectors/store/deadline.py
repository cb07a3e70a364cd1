"""A load deadline from a live cost model: a hit is offered only when loading it is expected to beat recomputing it.

With ``scheduler.load_deadline`` on, each store scheduler half keeps a :class:`CostModel` of its
store and its engine, from kvdi's own measurements:

- the store's lookup **round trip** (seconds): every lookup kvdi makes (a batched background one
  or one inside the step), and a rare background probe while lookups are skipped;
- the store's **load throughput** (bytes/s): every prefetch at lookup, from the step it was asked
  for to the step its report arrived, less a round trip (what a request waiting for it spends);
- the engine's **prefill rate** (tokens/s): the tokens each engine step scheduled over the time
  to the next step (:meth:`CostModel.step`, the scheduler half's ``build_connector_meta``), taken
  from steps of at least :data:`MIN_STEP_TOKENS`, less a step's **fixed part** (seconds: the time of
  decode steps, whatever their tokens). Recomputing tokens in a step of their own costs the fixed part
  and the tokens at the rate; joining a step that runs anyway, the tokens alone. Until the rate is
  measured the rule refuses nothing.

The estimates live in :mod:`.deadline_estimates`: the throughput and the prefill rate are exponentially weighted
moving averages; the round trip is the median of recent samples, which a jittered store's lone slow answer does not
move (a rise is believed at once only from an overrun, or once it persists: :class:`RoundTrips`). Each sample is
clamped to bounds. :class:`DeadlineRule` applies the rule, with ``margin`` = ``scheduler.load_deadline_margin``:

- recomputing a request costs the engine step it joins, not its tokens alone: a request the rule sends to compute
  joins the others it sent to compute in the same step (:attr:`DeadlineRule.joining`, their tokens, reset each
  step), so four requests arriving together are judged on one, two, three and four prompts' recompute (judged one
  by one, each on its own prompt, all four were skipped at 5 ms, or at 0 ms on a fast engine, and recomputed in one
  step four prompts long, slower than loading them at once);
- a lookup whose answer, plus the expected load of a whole hit (a round trip, and the bytes at the throughput once
  it is measured), comes later than ``margin`` x recomputing the request's uncached prompt with the step's joining
  tokens is not made: the answer is 0 at once (``lookups_skipped``). The answer is used only when vLLM asks again,
  after the step those joining requests compute in, so a lookup waits for the longer of its round trip and that
  step (judged on its round trip alone, the fourth of four arrivals 50 ms away was looked up, waited out the others'
  step, then computed a step later: 1.16x no connector's time to first token at p90). A lookup once made is not
  judged again when vLLM asks again (its deadline bounds it; judged again, with the step's joining tokens gone, it
  was skipped after waiting a step for nothing). While lookups are skipped a probe (one lookup of a key no store
  holds) runs in the background at most every :data:`PROBE_INTERVAL_S`, so a store that recovers is used again;
- a hit whose expected load (a round trip and its bytes at the throughput) costs more than ``margin`` x
  recomputing its tokens is not offered (``deadline_refused``);
- a prefetch (or a background lookup) still running ``deadline_s`` after it was asked for is abandoned:
  ``margin`` x recomputing, or :data:`OUTLIER` x what it was expected to take if that is sooner (a store
  that turned slow costs a few expected round trips, not a recompute; expected at the slow end of recent round
  trips, so a jittered store's usual outliers are not overruns), at least :data:`MIN_DEADLINE_S`, and never
  shorter than the store's usual slow end (:meth:`DeadlineRule.slow_end_s`: the slow end of recent round trips
  plus the bytes at the throughput), itself at most ``margin + 1`` x recomputing (a wait past the budget costs a
  request at most one recompute more; before, a jittered store's usual slow prefetch was abandoned at the budget
  and recomputed, paying both);
  the request computes, the late bytes land in host staging that is dropped, never in a KV block
  (``deadline_recomputes``), and the round trip estimate rises to at least the time it ran, so the next
  lookups are skipped until the store answers faster (a probe).

A probe whose round trip lies beyond :data:`~.deadline_estimates.SHIFT` x the estimate asks again at once (at most
:data:`~.deadline_estimates.SHIFT_SAMPLES` probes in all): a store that moved is believed within a few round trips,
a jittered outlier is outvoted.

Cold start and idle engines: :meth:`DeadlineRule.start` (the scheduler half, once its lookups run in the background:
a remote store) starts a background thread that probes the store at once and again whenever no round trip was
sampled for :data:`REFRESH_S` (the same probe, never on the scheduler's thread), so the first requests of an engine,
or the first after an idle spell in which the store turned slow, are judged on a fresh round trip instead of
paying for an overrun to learn it. Under traffic the lookups themselves are the samples and it stays quiet.

A background load already writing into KV blocks (``transfer.async_load``) has the same deadline as a prefetch of
its bytes; past it, it is cancelled safely (:mod:`.deadline_loads`) and counted the same way.

A stalled store: once a wait overran (:meth:`DeadlineRule.overran`) and until the store answers anything again (a
lookup, a prefetch's report, a probe), the store is *suspect*: every other lookup or prefetch still waiting on it
is abandoned at its next ask (its deadline is 0), not each after its own deadline.

Every decision is logged at debug with the estimates it used; the counters are the scheduler half's
(:class:`DeadlineStats`: the stats file, vLLM's log line and the Prometheus series ``vllm:kvdi_deadline_*``).
The background lookups and the probe fold their round trips in from their own threads (a sample lost to a
race is harmless); the counters move on the scheduler's thread only.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdi.connectors.base import ConnectorStats
from kvdi.connectors.store.deadline_estimates import MIN_STEP_TOKENS, SHIFT_SAMPLES, CostModel, Ewma, RoundTrips
from kvdi.connectors.store.keys import KEY_BYTES
from kvdi.connectors.store.protocol import BlockStore

logger = logging.getLogger(__name__)

MIN_DEADLINE_S = 0.02
"""No prefetch or background lookup is abandoned sooner than this (it absorbs an engine step's granularity)."""

OUTLIER = 4.0
"""A prefetch or lookup taking this many times its expected time is abandoned even within its budget."""

PROBE_INTERVAL_S = 2.0
"""While lookups are skipped, the store's round trip is probed in the background at most this often."""

REFRESH_S = 0.5
"""With the background prober started (:meth:`DeadlineRule.start`), the store is probed when no round trip was
sampled for this long (an idle engine's estimate stays fresh: one cheap lookup of a missing key per interval)."""


@dataclass
class DeadlineStats(ConnectorStats):
    """A store scheduler half's counters, with the rule's decisions (0 while ``scheduler.load_deadline`` is off)."""

    lookups_skipped: int = 0  # lookups not made: their round trip costs more than recomputing the request
    deadline_refused: int = 0  # hits not offered: loading them costs more than recomputing them
    deadline_recomputes: int = 0  # prefetches or background lookups past their deadline: abandoned, recomputed
    deadline_probes: int = 0  # background round-trip probes of a store whose lookups are skipped

    def merge(self, other: ConnectorStats) -> DeadlineStats:
        """A new object with each counter summed (``other`` may be a plain :class:`ConnectorStats`)."""
        mine, theirs = self.as_dict(), other.as_dict()
        values: dict[str, Any] = {k: mine[k] + theirs.get(k, 0) for k in mine}
        return DeadlineStats(**values)


class DeadlineRule:
    """The rule over one store's :class:`CostModel`; counts its decisions in ``stats`` (the scheduler half's)."""

    def __init__(
        self,
        store: BlockStore,
        name: str,
        stats: DeadlineStats,
        *,
        enabled: bool,
        margin: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.name = name
        self.stats = stats
        self.enabled = enabled
        self.margin = margin
        self.model = CostModel(clock)
        self._probe_at = -PROBE_INTERVAL_S
        self._probing = False
        self._probes = 0  # probes answered, counted into ``stats`` on the scheduler's thread (:meth:`step`)
        self.joining = 0  # tokens this step's requests recompute by the rule's answers: a recompute joins them
        self._lock = threading.Lock()
        self._sampled_at = float("-inf")  # when the store last answered (a round trip or a load sampled)
        self.suspect = False  # a wait overran and the store has not answered since: in-flight waits are abandoned
        self._stop: threading.Event | None = None  # set to stop the background prober (:meth:`start`)

    @property
    def clock(self) -> Callable[[], float]:
        return self.model.clock

    def step(self, tokens: int) -> None:
        """An engine step scheduled ``tokens`` (the prefill rate's sample); probes answered since are counted."""
        self.model.step(tokens)
        self.joining = 0
        with self._lock:
            probes, self._probes = self._probes, 0
        self.stats.deadline_probes += probes

    def answered(self, seconds: float) -> None:
        """A lookup answered in ``seconds`` (a round-trip sample): the store is not stalled."""
        self.model.round_trip(seconds)
        self._heard()

    def loaded(self, nbytes: int, seconds: float) -> None:
        """A prefetch of ``nbytes`` was reported ``seconds`` after it was asked for (a throughput sample)."""
        self.model.transfer(nbytes, seconds)
        self._heard()

    def _heard(self) -> None:
        self._sampled_at, self.suspect = self.clock(), False

    def describe(self) -> str:
        """One line: the rule and its margin (the vLLM adapter logs it once at start)."""
        return (
            f"load deadline on (scheduler.load_deadline_margin={self.margin:g}): a hit loads only when expected to "
            f"beat recompute; lookups and prefetches past their deadline are recomputed ({self.model.describe()})"
        )

    def budget_s(self, tokens: int) -> float | None:
        """What recomputing ``tokens`` costs, times the margin; None until the prefill rate is measured."""
        recompute = self.model.recompute_s(tokens)
        return None if recompute is None else self.margin * recompute

    def skip_lookup(self, uncached_tokens: int, loadable_bytes: int = 0) -> bool:
        """True when a lookup's answer, plus the expected load of its best hit (``loadable_bytes``), comes later than
        recomputing ``uncached_tokens`` in the step it would join: even a whole hit cannot pay off (counted, and a
        background probe of the round trip is started when one is due).

        The answer is used when vLLM asks again, after this step: its round trip, or the step of the requests the
        rule already sent to compute (:attr:`joining`) if that is longer. The load is a round trip and the bytes at
        the throughput; a round trip alone until the throughput is measured (it never costs nothing)."""
        budget = self.budget_s(uncached_tokens + self.joining) if self.enabled else None
        rtt = self.model.rtt.value
        load = self.model.load_s(loadable_bytes) if loadable_bytes > 0 else None
        if load is None and loadable_bytes > 0:
            load = rtt  # the hit's own round trip: counted before the first prefetch measured the throughput
        step = self.model.recompute_s(self.joining) or 0.0
        expected = None if rtt is None else max(rtt, step) + (load or 0.0)
        if budget is None or expected is None or expected <= budget:
            return False
        self.stats.lookups_skipped += 1
        self.joining += uncached_tokens
        logger.debug("kv connector %r: lookup skipped, %d tokens recompute: its answer and best load %.2f ms > budget "
                     "%.2f ms (%s)", self.name, uncached_tokens, expected * 1e3, budget * 1e3,
                     self.model.describe())  # fmt: skip
        self._maybe_probe()
        return True

    def offer(self, hit_tokens: int, hit_bytes: int) -> bool:
        """False (counted) when loading a hit of ``hit_tokens`` (``hit_bytes``) is expected to cost more than
        recomputing it; True otherwise, and while the estimates are not measured."""
        budget = self.budget_s(hit_tokens + self.joining) if self.enabled else None
        load = self.model.load_s(hit_bytes)
        if budget is None or load is None or load <= budget:
            return True
        self.stats.deadline_refused += 1
        self.joining += hit_tokens
        logger.debug("kv connector %r: hit of %d tokens not offered: load %.2f ms > budget %.2f ms (%s)",
                     self.name, hit_tokens, load * 1e3, budget * 1e3, self.model.describe())  # fmt: skip
        return False

    def deadline_s(self, tokens: int, nbytes: int | None = None) -> float:
        """How long a background lookup (``nbytes`` None) or a prefetch of ``nbytes`` for ``tokens`` may run before
        it is abandoned (inf: the rule is off or the prefill rate not measured)."""
        budget = self.budget_s(tokens) if self.enabled else None
        if budget is None:
            return float("inf")
        if self.suspect:
            return 0.0  # another wait on this store overran and it has not answered since: stop waiting now
        deadline, slow_end = budget, self.slow_end_s(tokens, nbytes)
        if slow_end is not None:
            deadline = max(min(budget, OUTLIER * slow_end), slow_end)
        return max(deadline, MIN_DEADLINE_S)

    def slow_end_s(self, tokens: int, nbytes: int | None = None) -> float | None:
        """How long a background lookup (``nbytes`` None) or a load of ``nbytes`` takes at the store's usual slow
        end (the slow end of recent round trips, :attr:`~.deadline_estimates.RoundTrips.tail`, plus the bytes at the
        throughput), at most the budget plus one more recompute of ``tokens``: no deadline is shorter (a wait that
        long is the store's usual, not an overrun; abandoning it costs the wait and a recompute), and waiting past
        the budget costs a request at most one recompute more. None until measured."""
        expected = self.model.rtt.tail if nbytes is None else self.model.load_s(nbytes, tail=True)
        recompute = self.model.recompute_s(tokens)
        if expected is None or recompute is None:
            return expected
        return min(expected, (self.margin + 1.0) * recompute)

    def overran(self, what: str, tokens: int, elapsed_s: float) -> None:
        """A prefetch or lookup ran past its deadline and was abandoned: counted, and the round trip is at least
        ``elapsed_s`` (the next lookups are skipped until a probe is fast)."""
        self.stats.deadline_recomputes += 1
        self.model.at_least(elapsed_s)
        self.suspect = True
        logger.debug("kv connector %r: %s for %d tokens abandoned after %.2f ms, recomputing (%s)", self.name, what,
                     tokens, elapsed_s * 1e3, self.model.describe())  # fmt: skip

    def _maybe_probe(self) -> None:
        now = self.clock()
        with self._lock:
            if self._probing or now - self._probe_at < PROBE_INTERVAL_S:
                return
            self._probing, self._probe_at = True, now
        threading.Thread(target=self.probe, name=f"kvdi-{self.name}-probe", daemon=True).start()

    def probe(self) -> float | None:
        """Lookups of a key no store holds, their round trips folded into the estimate: one, and more (up to
        :data:`~.deadline_estimates.SHIFT_SAMPLES`) while each lies beyond the estimate's spread (an outlier or a
        store that moved: the next ones tell); the last round trip (None: the store failed)."""
        seconds: float | None = None
        try:
            for _ in range(SHIFT_SAMPLES):
                seconds = self._probe_once()
                if seconds is None or not self.model.rtt.unsettled:
                    break
        finally:
            with self._lock:
                self._probing = False
        logger.debug("kv connector %r: round trip probe: %s", self.name, self.model.describe())
        return seconds

    def _probe_once(self) -> float | None:
        try:
            start = self.clock()
            self.store.count_prefix([os.urandom(KEY_BYTES)])
            seconds: float | None = self.clock() - start
        except Exception:  # a store that cannot answer stays skipped until a probe succeeds
            seconds = None
        if seconds is not None:
            with self._lock:
                self.model.round_trip(seconds)
                self._probes += 1
                self._heard()
        return seconds

    def refresh(self) -> bool:
        """Probe now (on this thread) when no round trip was sampled for :data:`REFRESH_S` and no probe runs;
        True when it probed."""
        now = self.clock()
        with self._lock:
            if self._probing or now - self._sampled_at < REFRESH_S:
                return False
            self._probing, self._probe_at = True, now
        self.probe()
        return True

    def start(self) -> None:
        """Start the background prober (once; the rule on only): a probe now, then :meth:`refresh` whenever
        :data:`REFRESH_S` passed since the store last answered (asleep until then), so the estimate is there before
        the first request and fresh after an idle spell."""
        if not self.enabled or self._stop is not None:
            return
        stop = self._stop = threading.Event()

        def run() -> None:
            while True:
                self.refresh()
                with self._lock:  # asleep until the next probe is due (a store that fails: again in REFRESH_S / 5)
                    due_in = self._sampled_at + REFRESH_S - self.clock()
                if stop.wait(min(REFRESH_S, max(REFRESH_S / 5, due_in))):
                    return

        threading.Thread(target=run, name=f"kvdi-{self.name}-prober", daemon=True).start()

    def stop(self) -> None:
        """Stop the background prober (a probe under way ends with the store's own timeout)."""
        if self._stop is not None:
            self._stop.set()


__all__ = [
    "MIN_DEADLINE_S",
    "MIN_STEP_TOKENS",
    "PROBE_INTERVAL_S",
    "REFRESH_S",
    "CostModel",
    "DeadlineRule",
    "DeadlineStats",
    "Ewma",
    "RoundTrips",
]
