"""The circuit breaker in front of a remote store: each Redis server or cluster node, each S3 endpoint.

A breaker counts consecutive failures; after ``failures`` of them it opens for ``reset_s``
(the caller answers misses instead of calling the server), then lets one call through as a
probe (half-open) and closes when that call reaches the server.

Every change of state is counted where it happens, in :class:`BreakerMoves` (one per breaker, or one shared by a
store's breakers), so a reader of the breakers' states (the Prometheus gauge of a node's breaker) can skip the read
while the count stands still. Nothing changes with the clock alone: an open breaker whose reset time passed still
reads OPEN until the next call's :meth:`CircuitBreaker.allow` makes that call the probe (half-open), and that is
a counted change.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerOpenError(ConnectionError):
    """A call refused without reaching the server because its breaker is open."""


class BreakerState(enum.Enum):
    """Circuit breaker states: calls go through (closed), are refused (open), or one probe runs (half-open)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerMoves:
    """How many times the breakers it counts for changed state (or, for a store that adds breakers as it meets
    nodes, gained one): their states are what they were at the last read while ``count`` stands still.

    ``count`` is a plain attribute, read without a call; :meth:`moved` holds a lock so no move of breakers sharing
    one count is lost."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def moved(self) -> None:
        """Count one change; call it after the change is made (a reader that sees the count sees the change)."""
        with self._lock:
            self.count += 1


class CircuitBreaker:
    """Counts consecutive failures; opens after ``failures`` of them for ``reset_s``, then lets one probe through.

    Thread-safe. ``clock`` is injectable so the policy can be tested without sleeping. ``moves`` counts every change
    of :attr:`state` (its own count when None: :class:`BreakerMoves`).
    """

    def __init__(
        self,
        failures: int,
        reset_s: float,
        clock: Callable[[], float] = time.monotonic,
        moves: BreakerMoves | None = None,
    ) -> None:
        self.threshold = failures
        self.reset_s = reset_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self.times_opened = 0
        self.moves = moves if moves is not None else BreakerMoves()

    @property
    def state(self) -> BreakerState:
        """The current state (an open breaker whose reset time passed still reads OPEN until probed)."""
        return self._state

    def allow(self) -> bool:
        """True when the caller may call the server; the first caller after the reset time becomes the probe."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.reset_s:
                self._state = BreakerState.HALF_OPEN  # the reset time passed: this call probes
                self.moves.moved()
                return True
            return False

    def record_success(self) -> bool:
        """Note a call that reached the server; True when this closed an open or half-open breaker."""
        with self._lock:
            was_tripped = self._state is not BreakerState.CLOSED
            self._state = BreakerState.CLOSED
            self._failures = 0
            if was_tripped:
                self.moves.moved()
            return was_tripped

    def release_probe(self) -> None:
        """End a probe that neither reached nor failed to reach the server: back to OPEN, probe again later."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                self._state = BreakerState.OPEN
                self._opened_at = self._clock() - self.reset_s
                self.moves.moved()

    def record_failure(self) -> bool:
        """Note a failed call; True when this (re)opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self._failures >= self.threshold
            ):
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                self.times_opened += 1
                self.moves.moved()
                return True
            return False
