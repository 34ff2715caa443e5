"""Helpers shared by the test rooms: live servers, tiny checkpoints, engines, scripts run as child processes."""

import time


def wait_for(predicate, timeout: float, interval: float = 0.1) -> bool:
    """Poll predicate until it holds or timeout seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
