"""coordinator/keepalive.py: heartbeat plans while rank 0 runs a slow handler, timed from
the channel's last plan (so back-to-back calls cannot starve the other ranks either), none
while not busy, never one in flight once the handler returns (the main thread then owns the
plan channel again), and a failing heartbeat stops the heartbeats without raising."""

from __future__ import annotations

import threading
import time

from tapserve.coordinator.keepalive import PlanKeepalive
from tests.helpers import wait_for


class _Channel:
    """Stands for PlanChannel: records heartbeats and when the last plan went out."""

    def __init__(self, send_seconds: float = 0.0, fail: bool = False):
        self.times: list[float] = []
        self.attempts = 0
        self.last_sent = time.monotonic()
        self.in_send = threading.Event()
        self.send_seconds, self.fail = send_seconds, fail

    def heartbeat(self) -> None:
        self.attempts += 1
        self.in_send.set()
        time.sleep(self.send_seconds)
        if self.fail:
            self.in_send.clear()
            raise RuntimeError("the peer is gone")
        self.last_sent = time.monotonic()
        self.times.append(self.last_sent)
        self.in_send.clear()


def _keepalive(channel: _Channel, period: float) -> PlanKeepalive:
    return PlanKeepalive(channel.heartbeat, lambda: channel.last_sent, period)


def test_heartbeats_only_while_busy():
    channel = _Channel()
    keepalive = _keepalive(channel, 0.05)
    time.sleep(0.2)
    assert channel.times == []  # idle: the loop's own heartbeats, not these
    with keepalive.busy():
        assert wait_for(lambda: len(channel.times) >= 3, 60, interval=0.005), channel.times
    during = len(channel.times)
    gaps = [b - a for a, b in zip(channel.times, channel.times[1:])]
    assert min(gaps) > 0.05 - 1e-6, gaps  # timed from the last plan: one per 50 ms at most
    time.sleep(0.2)
    assert len(channel.times) == during  # none after the call


def test_short_calls_in_a_row_still_send_heartbeats():
    """Twenty 40 ms calls with no plan between them: heartbeats every 50 ms of the run, as
    if it were one call (a burst of requests whose selectors each take a while)."""
    channel = _Channel()
    keepalive = _keepalive(channel, 0.05)
    for _ in range(20):
        with keepalive.busy():
            time.sleep(0.04)
    assert len(channel.times) >= 4, channel.times
    channel = _Channel()  # one heartbeat per second at most: a loaded machine cannot reach it
    keepalive = _keepalive(channel, 1.0)
    channel.last_sent = time.monotonic()  # a real plan just went out
    with keepalive.busy():
        time.sleep(0.01)
    time.sleep(0.05)
    assert channel.times == []  # no heartbeat right after a plan


def test_leaving_busy_waits_for_a_heartbeat_in_progress():
    channel = _Channel(send_seconds=0.2)
    keepalive = _keepalive(channel, 0.02)
    with keepalive.busy():
        assert channel.in_send.wait(60)  # a heartbeat has started
    left = time.monotonic()
    assert not channel.in_send.is_set()  # busy() returned only after it ended
    assert channel.times and channel.times[-1] <= left


def test_a_failing_heartbeat_stops_the_heartbeats_quietly():
    channel = _Channel(fail=True)
    keepalive = _keepalive(channel, 0.02)
    with keepalive.busy():  # the first heartbeat fails; busy() itself raises nothing
        assert wait_for(lambda: channel.attempts == 1, 60, interval=0.005)
    channel.fail = False
    with keepalive.busy():
        time.sleep(0.1)
    assert channel.times == []  # the group is broken: no more tries
