"""How the API process ends: rank 0 decides (DESIGN.md "Processes").

This process stops serving when rank 0 says the engine has stopped (wire.Shutdown). A SIGTERM
or SIGINT sent to it is handed to rank 0 as a drain request while the engine runs; it stops
serving at once when the engine has stopped, rank 0 is gone, or on a repeat after the engine
has been silent for ENGINE_SILENT_SECONDS (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
import zmq

from tapserve.api import wire
from tapserve.api.config import KEY_FILE, ApiConfig
from tapserve.api.engine_client import ENGINE_DOWN, EngineClient, EngineError

log = logging.getLogger("tapserve.api")
ENGINE_SILENT_SECONDS = 3.0  # rank 0 sends stats every second, while it drains too


class Lifecycle:
    """The link between uvicorn's server, the engine client and the parent process."""

    def __init__(self, parent_pid: int):
        self.parent_pid = parent_pid
        self.stop_serving: Callable[[], None] = lambda: None  # set by the server: ends serving
        self._client: EngineClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: tuple[int, float] | None = None  # a signal (and when) before attach
        self._first_signal_at: float | None = None
        self._detached = False

    def attach(self, client: EngineClient) -> None:
        """Called on the event loop once the client has connected: signals now go to rank 0."""
        self._client, self._loop = client, asyncio.get_running_loop()
        client.on_stopped = lambda: self.stop_serving()
        if self._pending is not None:
            log.info("signal %d came while starting: asking the engine to drain", self._pending[0])
            self._request_drain(client, *self._pending)

    def detach(self) -> None:
        self._client = self._loop = None
        self._detached = True

    def hand_to_engine(self, signum: int) -> bool:
        """Runs in the signal handler: ask rank 0 to drain (True), or False: stop serving now."""
        client, loop, now = self._client, self._loop, time.monotonic()
        repeat = self._first_signal_at is not None
        if not repeat:
            self._first_signal_at = now
        if self._detached or os.getppid() != self.parent_pid:
            return False
        if client is None or loop is None:  # starting: handed on at attach
            self._pending = signum, now
            return True
        if loop.is_closed() or client.engine_stopped:
            return False
        heard = max(client.last_message_time or 0.0, self._first_signal_at)
        if repeat and now - heard >= ENGINE_SILENT_SECONDS:
            log.error(
                "signal %d: the engine has been silent for %.0f s or more; stopping",
                signum,
                ENGINE_SILENT_SECONDS,
            )
            loop.call_soon_threadsafe(self._give_up, client, signum, now)
            return False
        log.info("signal %d: asking the engine to drain (it stops this process when done)", signum)
        loop.call_soon_threadsafe(self._request_drain, client, signum, now)  # not in a handler
        return True

    def _request_drain(self, client: EngineClient, signum: int, signal_time: float) -> None:
        try:
            client.request_drain(signum, signal_time)
        except zmq.ZMQError as e:
            log.error("cannot reach the engine (%s); stopping", e)
            self.stop_serving()

    def _give_up(self, client: EngineClient, signum: int, signal_time: float) -> None:
        """Stop without the engine: answer every request in flight (503) now."""
        client.stop_accepting("the server stopped: the engine did not answer its drain request")
        with contextlib.suppress(zmq.ZMQError):
            client.request_drain(signum, signal_time)


class Server(uvicorn.Server):
    """uvicorn's server, its SIGTERM and SIGINT handed to rank 0 while the engine runs."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.stop_serving = self.stop_serving

    def stop_serving(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not uvicorn's: it would raise the signal again after the shutdown (exit by signal)
        if self.lifecycle.hand_to_engine(sig):
            return
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C, as uvicorn
        self.should_exit = True


async def watchdog(config: ApiConfig, client: EngineClient, lifecycle: Lifecycle) -> None:
    """Stop serving when the parent is gone (in-flight requests are answered with an error
    at once); fail in-flight requests when the engine stays silent."""
    while True:
        await asyncio.sleep(0.5)
        if os.getppid() != lifecycle.parent_pid:
            log.error("parent process %d is gone; stopping", lifecycle.parent_pid)
            client.stop_accepting("the engine is gone")
            remove_ipc_dir(config.ipc_dir)  # rank 0, which made it, cannot any more
            lifecycle.stop_serving()
            return
        last = client.last_message_time
        if (
            client.num_in_flight
            and last is not None
            and time.monotonic() - last > config.engine_timeout_s
        ):
            client.fail_all(EngineError(ENGINE_DOWN, "the engine stopped answering"))


def remove_ipc_dir(ipc_dir: str) -> None:
    """The files rank 0 puts in its ipc dir, then the dir if nothing else is in it."""
    for name in (wire.TO_ENGINE, wire.FROM_ENGINE, KEY_FILE):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(ipc_dir, name))
    with contextlib.suppress(OSError):
        os.rmdir(ipc_dir)
