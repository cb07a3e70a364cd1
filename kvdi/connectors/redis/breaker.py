"""The circuit breaker in front of each Redis server: :mod:`kvdi.connectors.breaker` (shared with ``s3``)."""

from __future__ import annotations

from kvdi.connectors.breaker import BreakerMoves, BreakerOpenError, BreakerState, CircuitBreaker

__all__ = ["BreakerMoves", "BreakerOpenError", "BreakerState", "CircuitBreaker"]
