"""Warn once per reason per interval: a failure that repeats every engine step is logged at most every
:data:`LOG_INTERVAL_S` seconds (per reason and owner), so a failure that comes back later, a second
outage of a store, is logged again."""

from __future__ import annotations

import logging
import time

LOG_INTERVAL_S = 60.0
"""Seconds between two warnings of one reason by one owner."""
_AT = "\x00"  # separates a reason from the time it was last logged, inside the owner's set


def log_once(logger: logging.Logger, seen: set[str], reason: str, message: str, *args: object) -> bool:
    """Log ``message % args`` as a warning unless ``reason`` was logged less than :data:`LOG_INTERVAL_S` ago.

    ``seen`` belongs to the caller (one set per connector or server) and holds, per reason, when it
    was last logged, so "once" means once per interval per owner. Returns whether the message was logged.
    """
    now = time.monotonic()
    prefix = reason + _AT
    last = next((entry for entry in seen if entry.startswith(prefix)), None)
    if last is not None:
        if now - float(last[len(prefix) :]) < LOG_INTERVAL_S:
            return False
        seen.discard(last)
    seen.add(f"{prefix}{now!r}")
    logger.warning(message, *args, stacklevel=2)  # file:line of the caller, not of this helper
    return True


__all__ = ["LOG_INTERVAL_S", "log_once"]
