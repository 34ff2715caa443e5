"""api/lifecycle.py's signal rules against a real EngineClient and real ZeroMQ sockets: the
PULL socket bound here stands where rank 0's is (tests/api/test_api_shutdown.py drives the same
rules through live servers)."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time

import pytest
import zmq

from tapserve.api import lifecycle, wire
from tapserve.api.engine_client import EngineClient
from tapserve.api.lifecycle import Lifecycle


class Rank0Sockets:
    """Rank 0's two sockets, bound in a temp ipc dir: what the API process sends, a way to speak."""

    def __init__(self, ipc_dir: str):
        self.ctx = zmq.Context()
        self.incoming = self.ctx.socket(zmq.PULL)
        self.incoming.bind(f"ipc://{ipc_dir}/{wire.TO_ENGINE}")
        self.outgoing = self.ctx.socket(zmq.PUSH)
        self.outgoing.bind(f"ipc://{ipc_dir}/{wire.FROM_ENGINE}")

    def received(self, count: int = 1, timeout_ms: int = 60_000) -> list[object]:
        """The messages that came: at least `count` (waiting up to timeout_ms for them), then
        any that follow within 50 ms. count=0: those within timeout_ms (none expected)."""
        out = []
        while self.incoming.poll(timeout_ms if len(out) < max(count, 1) else 50):
            out.append(wire.decode(self.incoming.recv()))
        return out

    def close(self) -> None:
        self.ctx.destroy(0)


def run_with_client(body) -> None:
    """Run `body(lifecycle, client, rank0)` on an event loop, the client connected."""
    with tempfile.TemporaryDirectory() as ipc_dir:
        rank0 = Rank0Sockets(ipc_dir)

        async def main():
            client = EngineClient(ipc_dir)
            await client.start()
            try:
                await body(Lifecycle(os.getppid()), client, rank0)
            finally:
                await client.close()

        try:
            asyncio.run(main())
        finally:
            rank0.close()


def signals(messages: list[object]) -> list[int]:
    """The signals of the drain requests among messages."""
    return [m.signal for m in messages if isinstance(m, wire.DrainRequest)]


def test_a_signal_before_attach_is_handed_on_at_attach():
    async def body(life: Lifecycle, client: EngineClient, rank0: Rank0Sockets):
        came = time.monotonic()
        assert life.hand_to_engine(signal.SIGTERM)  # serving goes on: it is kept
        handled = time.monotonic()
        await asyncio.sleep(0.3)
        life.attach(client)
        received = await asyncio.to_thread(rank0.received)
        assert signals(received) == [signal.SIGTERM]
        assert came <= received[0].signal_time <= handled  # when it came, not when sent

    run_with_client(body)


def test_a_repeat_stops_serving_only_when_the_engine_is_silent(monkeypatch):
    monkeypatch.setattr(lifecycle, "ENGINE_SILENT_SECONDS", 1.0)

    async def body(life: Lifecycle, client: EngineClient, rank0: Rank0Sockets):
        life.attach(client)
        assert life.hand_to_engine(signal.SIGTERM)
        assert life.hand_to_engine(signal.SIGINT)  # at once: the engine may answer yet
        received = await asyncio.to_thread(rank0.received, 2)
        assert signals(received) == [signal.SIGTERM, signal.SIGINT]
        rank0.outgoing.send(wire.encode(wire.EngineStats()))
        for _ in range(3000):  # heard just now: still forwarded
            if client.last_message_time is not None:
                break
            await asyncio.sleep(0.01)
        assert client.last_message_time is not None
        assert life.hand_to_engine(signal.SIGTERM)
        group = client.submit([wire.AddRequest("r1", [1, 2], {})])
        await asyncio.sleep(1.1)  # silent for more than 1 s: serving stops, the request is answered
        assert not life.hand_to_engine(signal.SIGINT)
        answer = await asyncio.wait_for(group.queue.get(), 60)
        assert answer.code == 503 and client.shutting_down
        received = await asyncio.to_thread(rank0.received, 2)  # rank 0 hears it all the same
        assert signals(received) == [signal.SIGTERM, signal.SIGINT], received

    run_with_client(body)


def test_once_the_engine_has_stopped_a_signal_stops_serving():
    stopped: list[float] = []

    async def body(life: Lifecycle, client: EngineClient, rank0: Rank0Sockets):
        life.stop_serving = lambda: stopped.append(time.monotonic())
        life.attach(client)
        rank0.outgoing.send(wire.encode(wire.Shutdown("engine stopped", stopped=True)))
        for _ in range(3000):
            if stopped:
                break
            await asyncio.sleep(0.02)
        assert stopped, "the final Shutdown did not stop serving"
        assert not life.hand_to_engine(signal.SIGTERM)
        assert await asyncio.to_thread(rank0.received, 0, 300) == []

    run_with_client(body)


@pytest.mark.parametrize("when", ["detached", "orphaned"])
def test_after_detach_or_without_the_parent_a_signal_stops_serving(when):
    async def body(life: Lifecycle, client: EngineClient, rank0: Rank0Sockets):
        life.attach(client)
        if when == "detached":
            life.detach()
        else:
            life.parent_pid = -1  # as if rank 0 were gone
        assert not life.hand_to_engine(signal.SIGTERM)
        assert await asyncio.to_thread(rank0.received, 0, 300) == []

    run_with_client(body)
