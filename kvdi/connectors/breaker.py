"""The circuit breaker in front of a remote store: each Redis server or cluster node, each S3 endpoint.

A breaker counts consecutive failures; after ``failures`` of them it opens for ``reset_s``
(the caller answers misses instead of calling the server), then lets one call through as a
probe (half-open) and closes when that call reaches the server.
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


class CircuitBreaker:
    """Counts consecutive failures; opens after ``failures`` of them for ``reset_s``, then lets one probe through.

    Thread-safe. ``clock`` is injectable so the policy can be tested without sleeping.
    """

    def __init__(self, failures: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = failures
        self.reset_s = reset_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self.times_opened = 0

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
                self._state = BreakerState.HALF_OPEN
                return True
            return False

    def record_success(self) -> bool:
        """Note a call that reached the server; True when this closed an open or half-open breaker."""
        with self._lock:
            was_tripped = self._state is not BreakerState.CLOSED
            self._state = BreakerState.CLOSED
            self._failures = 0
            return was_tripped

    def release_probe(self) -> None:
        """End a probe that neither reached nor failed to reach the server: back to OPEN, probe again later."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                self._state = BreakerState.OPEN
                self._opened_at = self._clock() - self.reset_s

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
                return True
            return False
