"""How the API process's reader hands engine messages to a stream (api/engine_client.py), with
real ZeroMQ sockets: rank 0's are bound here, and a burst of one-token steps is made to wait in
the client's socket at once (the event loop is held while they arrive). Each step stays a batch
of its own (an SSE event each) unless CATCH_UP_BACKLOG or more wait: then the API is behind and
a stream takes them together."""

from __future__ import annotations

import asyncio
import tempfile
import time

import pytest

from tapserve.api import wire
from tapserve.api.engine_client import CATCH_UP_BACKLOG, EngineClient
from tests.api.test_api_lifecycle import Rank0Sockets


def batches_of_a_burst(steps: int) -> list[list[int]]:
    """The token ids of each batch a request's stream gets when its `steps` one-token steps
    (the last one finishing it) wait in the client's socket at once."""
    with tempfile.TemporaryDirectory() as ipc_dir:
        rank0 = Rank0Sockets(ipc_dir)

        async def main() -> list[list[int]]:
            client = EngineClient(ipc_dir)
            await client.start()
            try:
                rid = client.new_request_id("cmpl")
                group = client.submit([wire.AddRequest(rid, [1, 2, 3], {})])
                assert rank0.received(1)[0].request_id == rid
                rank0.outgoing.send(wire.encode(wire.Outputs([wire.RequestOutput(rid)])))
                await group.accepted()
                batches: list[list[int]] = []

                async def stream() -> None:
                    async for outputs in group.batches():
                        batches.append(
                            [t for o in outputs for s in o.sequences for t in s.new_token_ids]
                        )

                streaming = asyncio.create_task(stream())
                await asyncio.sleep(0.05)  # the stream waits for its first token
                for token in range(steps - 1):
                    rank0.outgoing.send(wire.encode(wire.Outputs([], [rid], [token])))
                last = wire.SequenceOutput(0, [steps - 1], finish_reason="length")
                rank0.outgoing.send(
                    wire.encode(
                        wire.Outputs([wire.RequestOutput(rid, sequences=[last], finished=True)])
                    )
                )
                time.sleep(1.0)  # the loop is held: every step arrives before the reader runs
                await asyncio.wait_for(streaming, 30)
                return batches
            finally:
                await client.close()

        try:
            return asyncio.run(main())
        finally:
            rank0.close()


@pytest.mark.parametrize("steps", [2, CATCH_UP_BACKLOG - 1])
def test_each_waiting_step_is_a_batch_of_its_own(steps):
    assert batches_of_a_burst(steps) == [[token] for token in range(steps)]


@pytest.mark.parametrize("steps", [CATCH_UP_BACKLOG, 3 * CATCH_UP_BACKLOG])
def test_a_backlog_of_steps_is_taken_together(steps):
    assert batches_of_a_burst(steps) == [list(range(steps))]
