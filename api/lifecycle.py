"""How the API process ends: rank 0 decides (DESIGN.md "Processes").

Rank 0 drains on SIGTERM or SIGINT and, when the drain is done, tells this process that the
engine has stopped (wire.Shutdown, stopped): this process then stops serving, as uvicorn does
on a signal (it finishes the responses it has data for). A SIGTERM or SIGINT sent to this
process itself (systemd's default `KillMode=control-group` signals every process of a unit)
is handed to rank 0 as a drain request while the engine runs, so that requests in flight
finish within `--shutdown-timeout` here too; rank 0 counts it as it counts its own signals.
Once the engine has stopped, or its parent (rank 0) is gone, a signal stops serving at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from types import FrameType
from typing import Callable

import uvicorn
import zmq

from api import wire
from api.config import KEY_FILE, ApiConfig
from api.engine_client import ENGINE_DOWN, EngineClient, EngineError

log = logging.getLogger("tapserve.api")


class Lifecycle:
    """The link between uvicorn's server, the engine client and the parent process."""

    def __init__(self, parent_pid: int):
        self.parent_pid = parent_pid
        self.stop_serving: Callable[[], None] = lambda: None  # set by the server: ends serving
        self._client: EngineClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, client: EngineClient) -> None:
        """Called in the app's lifespan, on the event loop: from now on signals go to rank 0
        while the engine runs."""
        self._client, self._loop = client, asyncio.get_running_loop()
        client.on_stopped = lambda: self.stop_serving()

    def detach(self) -> None:
        self._client = self._loop = None

    def hand_to_engine(self, signum: int) -> bool:
        """Runs in the signal handler: ask rank 0 to drain (True), unless the engine has
        stopped, never spoke, or its parent is gone (False: stop serving)."""
        client, loop = self._client, self._loop
        if client is None or loop is None or loop.is_closed() or client.engine_stopped \
                or client.last_message_time is None or os.getppid() != self.parent_pid:
            return False
        log.info("signal %d: asking the engine to drain (it stops this process when done)",
                 signum)
        loop.call_soon_threadsafe(self._request_drain, client, signum)  # not from a handler
        return True

    def _request_drain(self, client: EngineClient, signum: int) -> None:
        try:
            client.request_drain(signum)
        except zmq.ZMQError as e:
            log.error("cannot reach the engine (%s); stopping", e)
            self.stop_serving()


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
            client.shutting_down = True  # a request arriving from now on gets the 503 at once
            client.fail_all(EngineError(ENGINE_DOWN, "the engine is gone"))  # answer them now
            remove_ipc_dir(config.ipc_dir)  # rank 0, which made it, cannot any more
            lifecycle.stop_serving()
            return
        last = client.last_message_time
        if client.num_in_flight and last is not None \
                and time.monotonic() - last > config.engine_timeout_s:
            client.fail_all(EngineError(ENGINE_DOWN, "the engine stopped answering"))


def remove_ipc_dir(ipc_dir: str) -> None:
    """The files rank 0 puts in its ipc dir, then the dir if nothing else is in it."""
    for name in (wire.TO_ENGINE, wire.FROM_ENGINE, KEY_FILE):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(ipc_dir, name))
    with contextlib.suppress(OSError):
        os.rmdir(ipc_dir)
