"""Warn once per reason: a failure that repeats every engine step is logged the first time only."""

from __future__ import annotations

import logging


def log_once(logger: logging.Logger, seen: set[str], reason: str, message: str, *args: object) -> bool:
    """Log ``message % args`` as a warning unless ``reason`` is in ``seen`` (then add it).

    ``seen`` belongs to the caller (one set per connector or server), so "once" means once per
    owner. Returns whether the message was logged.
    """
    if reason in seen:
        return False
    seen.add(reason)
    logger.warning(message, *args)
    return True


__all__ = ["log_once"]
