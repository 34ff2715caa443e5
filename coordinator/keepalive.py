"""Heartbeat plans while rank 0 is busy outside the step loop (a deployment's handler).

Inside `PlanKeepalive.busy()` a helper thread sends a heartbeat plan whenever `period` seconds
have passed since the channel's last plan, so the other ranks never reach the peer timeout;
leaving `busy()` waits for a heartbeat in progress (docs/custom_output.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("tapserve.coordinator")
HEARTBEAT_SECONDS = 1.0  # how often rank 0 sends a heartbeat plan while it sends no other


class PlanKeepalive:
    def __init__(
        self,
        send_heartbeat: Callable[[], None],
        last_sent: Callable[[], float],
        period: float = HEARTBEAT_SECONDS,
    ):
        """last_sent: time.monotonic() of the channel's last plan (heartbeats included)."""
        self._send, self._last_sent, self._period = send_heartbeat, last_sent, period
        self._cond = threading.Condition()
        self._busy = False  # guarded by _cond
        self._failed = False  # a heartbeat raised: the group is broken, send no more
        self._thread = threading.Thread(target=self._run, daemon=True, name="tapserve-keepalive")
        self._thread.start()

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Heartbeats go out while the body runs (the body must not use the channel)."""
        with self._cond:
            self._busy = True
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:  # taken only between heartbeats: none is half sent after this
                self._busy = False

    def _run(self) -> None:
        with self._cond:
            while True:
                if not self._busy or self._failed:
                    self._cond.wait()
                    continue
                due = self._last_sent() + self._period - time.monotonic()
                if due > 0:
                    self._cond.wait(due)
                    continue
                try:
                    self._send()  # under the lock: busy() cannot end in the middle of it
                except Exception:  # the main thread's next plan meets the same broken group
                    log.exception("heartbeat plan failed; no more heartbeats")
                    self._failed = True
