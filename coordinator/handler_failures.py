"""Rank 0's log of custom output failures: 606s with their traceback, at most one per kind
("selector", "forward") per LOG_INTERVAL_SECONDS, those held back counted in the next."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("tapserve.coordinator.custom_output")
LOG_INTERVAL_SECONDS = 10.0


class FailureLog:
    def __init__(
        self,
        interval: float = LOG_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.interval, self.clock = interval, clock
        self._last_logged: dict[str, float] = {}
        self._held_back: dict[str, int] = {}

    def failed(self, kind: str, message: str, error: BaseException) -> bool:
        """One 606 of `kind`: logged with error's traceback unless one of the same kind was
        logged less than `interval` seconds ago (then counted). True if logged."""
        now = self.clock()
        last = self._last_logged.get(kind)
        if last is not None and now - last < self.interval:
            self._held_back[kind] = self._held_back.get(kind, 0) + 1
            return False
        self._last_logged[kind] = now
        held = self._held_back.pop(kind, 0)
        more = (
            f" ({held} more {kind} failures since the last traceback, not logged)" if held else ""
        )
        log.error("%s%s", message, more, exc_info=(type(error), error, error.__traceback__))
        return True
