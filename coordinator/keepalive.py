"""Heartbeat plans while rank 0 is busy outside the step loop (a deployment's handler).

The other ranks wait for rank 0's next plan at most the peer timeout (30 s) before they end
the group. While rank 0 runs a custom-output selector or `forward`, it is outside every
collective and sends no plan; a handler slower than the peer timeout used to end the server.
`PlanKeepalive.busy()` wraps such a call: a helper thread sends a heartbeat plan every
`period` seconds of it. The main thread sends nothing while it is busy, and leaving `busy()`
waits for a heartbeat in progress, so the channel is never used by two threads at once.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


HEARTBEAT_SECONDS = 1.0  # how often rank 0 sends a heartbeat plan while it sends no other


class PlanKeepalive:
    def __init__(self, send_heartbeat: Callable[[], None], period: float = HEARTBEAT_SECONDS):
        self._send, self._period = send_heartbeat, period
        self._cond = threading.Condition()
        self._busy_since: float | None = None  # guarded by _cond
        self._thread = threading.Thread(target=self._run, daemon=True, name="tapserve-keepalive")
        self._thread.start()

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Heartbeats go out while the body runs (the body must not use the channel)."""
        with self._cond:
            self._busy_since = time.monotonic()
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:  # taken only between heartbeats: none is half sent after this
                self._busy_since = None

    def _run(self) -> None:
        with self._cond:
            while True:
                if self._busy_since is None:
                    self._cond.wait()
                    continue
                due = self._busy_since + self._period - time.monotonic()
                if due > 0:
                    self._cond.wait(due)
                    continue
                self._send()  # under the lock: busy() cannot end in the middle of it
                self._busy_since = time.monotonic()
