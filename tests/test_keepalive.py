"""coordinator/keepalive.py: heartbeat plans while rank 0 runs a slow handler, none
otherwise, and never one in flight once the handler returns (the main thread then owns the
plan channel again)."""
from __future__ import annotations

import threading
import time

from coordinator.keepalive import PlanKeepalive


class _Recorder:
    def __init__(self, send_seconds: float = 0.0):
        self.times: list[float] = []
        self.in_send = threading.Event()
        self.send_seconds = send_seconds

    def __call__(self) -> None:
        self.in_send.set()
        time.sleep(self.send_seconds)
        self.times.append(time.monotonic())
        self.in_send.clear()


def test_heartbeats_only_while_busy():
    sent = _Recorder()
    keepalive = PlanKeepalive(sent, period=0.05)
    time.sleep(0.2)
    assert sent.times == []  # idle: the loop's own heartbeats, not these
    with keepalive.busy():
        time.sleep(0.33)
    during = len(sent.times)
    assert during >= 2, during  # one every 50 ms of a 330 ms call (fewer on a loaded machine)
    time.sleep(0.2)
    assert len(sent.times) == during  # none after the call
    with keepalive.busy():
        time.sleep(0.01)  # a fast call: no heartbeat at all
    time.sleep(0.1)
    assert len(sent.times) == during


def test_leaving_busy_waits_for_a_heartbeat_in_progress():
    sent = _Recorder(send_seconds=0.2)
    keepalive = PlanKeepalive(sent, period=0.02)
    with keepalive.busy():
        assert sent.in_send.wait(1.0)  # a heartbeat has started
    left = time.monotonic()
    assert not sent.in_send.is_set()  # busy() returned only after it ended
    assert sent.times and sent.times[-1] <= left
