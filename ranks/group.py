"""Process groups and the step-plan channel (docs/tensor_parallel.md).

Without RANK / WORLD_SIZE (torchrun or `launch.py --nproc-per-node`) tapserve runs as one
process with no group. The model's collectives use NCCL on CUDA, gloo on CPU; a second gloo
group carries plans. Both time out after `peer_timeout` seconds, bounding the wait for a peer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tapserve.model.layers import TPGroup
from tapserve.ranks.local_group import STORE_ENV
from tapserve.ranks.plan import (
    TRANSPORT_HEADER_BYTES,
    EncodedPlan,
    PlanDecoder,
    PlanMessage,
    StepPlan,
    decode_plan,
)

# the plan's length, the next message's size (little-endian uint64)
HEADER_BYTES = TRANSPORT_HEADER_BYTES


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    tp: TPGroup
    plan_group: Any  # gloo group for plans (None when world_size == 1)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def min_across_ranks(self, value: int) -> int:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.plan_group)
        return int(t.item())


def init_distributed(device_type: str, peer_timeout: float = 30.0) -> DistContext:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    store_file = os.environ.get(STORE_ENV)  # set by ranks/local_group.py
    if world_size == 1 and "TORCHELASTIC_RUN_ID" not in os.environ and store_file is None:
        return DistContext(0, 1, 0, TPGroup(), None)  # plain `python launch.py`: no group
    # launched as a group, even one rank joins a real group: the TP code path
    timeout = timedelta(seconds=peer_timeout)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend=backend,
        timeout=timeout,
        init_method=f"file://{store_file}" if store_file else None,
        rank=rank,
        world_size=world_size,
        device_id=torch.device("cuda", local_rank) if backend == "nccl" else None,
    )
    plan_group = dist.new_group(backend="gloo", timeout=timeout)
    # new_group may return on one rank while a peer still connects: were the first to leave
    # on a start-up error (a layout every rank refuses), the peer would fail in its connect
    dist.barrier(group=plan_group)
    tp = TPGroup(rank=rank, size=world_size, group=dist.group.WORLD)
    return DistContext(rank, world_size, local_rank, tp, plan_group)


class PlanChannel:
    """Broadcasts one StepPlan per step from rank 0 in a message of the size agreed by the
    last one's header (a larger plan sends its remainder in a second broadcast)."""

    def __init__(self, group: Any, min_message_bytes: int = 16 * 1024, spin_s: float = 0.0):
        """spin_s: how long a receiving rank polls for each plan before it blocks on it."""
        self.group = group
        self.spin_s = spin_s
        self.min_bytes = min_message_bytes
        self.size = min_message_bytes  # of the next message, agreed by both sides
        self.buffer = torch.zeros(min_message_bytes, dtype=torch.uint8)  # reused; grows
        self.rest = torch.zeros(0, dtype=torch.uint8)
        self._received = self.rest  # the receive buffer, reused; grows by powers of two
        self._decoder = PlanDecoder()  # a steady step's head is parsed once
        self.last_sent = time.monotonic()  # when rank 0 last sent a plan (of any kind)
        self._wire: PlanMessage | None = None  # the last laid-out message sent, and
        self._wire_body = self.rest  # a tensor over its buffer from its start

    def send(self, plan: StepPlan, timeout_s: float | None = None) -> None:
        """Broadcast one plan; timeout_s, if given, bounds each broadcast (RuntimeError past it)."""
        wire = plan.wire
        if wire is not None and wire.holds(plan):
            body, n = self._laid_out(plan, wire)
        else:  # the plan is written straight into the channel's buffer
            encoded = EncodedPlan(plan)
            n = encoded.nbytes
            body = self._message(max(self.size, HEADER_BYTES + n))
            encoded.write_into(body.numpy()[HEADER_BYTES:])
        next_size = self._next_size(n)
        body.numpy()[:HEADER_BYTES].view("<u8")[:] = n, next_size
        self._broadcast(body[: self.size], timeout_s)
        if HEADER_BYTES + n > self.size:  # the remainder: the same buffer's next bytes
            self._broadcast(body[self.size : HEADER_BYTES + n], timeout_s)
        self.size = next_size
        self.last_sent = time.monotonic()

    def _broadcast(self, data: torch.Tensor, timeout_s: float | None) -> None:
        if timeout_s is None:
            dist.broadcast(data, src=0, group=self.group)
        else:
            dist.broadcast(data, src=0, group=self.group, async_op=True).wait(
                timeout=timedelta(seconds=timeout_s)
            )

    def _laid_out(self, plan: StepPlan, wire: PlanMessage) -> tuple[torch.Tensor, int]:
        """(bytes to broadcast, message length) for a plan in its PlanMessage: the message's own
        buffer, unless the agreed size outgrows its room (then a copy in the channel's)."""
        wire.seal(plan)
        n, start = wire.nbytes, wire.start
        if start + self.size <= wire.buffer.size:
            if wire is not self._wire:
                self._wire, self._wire_body = wire, torch.from_numpy(wire.buffer)[start:]
            return self._wire_body, n
        body = self._message(max(self.size, HEADER_BYTES + n))
        message = slice(start + HEADER_BYTES, start + HEADER_BYTES + n)
        body.numpy()[HEADER_BYTES : HEADER_BYTES + n] = wire.buffer[message]
        return body, n

    def recv(self) -> StepPlan:
        """The next plan, its arrays views of the one receive buffer: valid until the next recv
        (a pinned buffer would break the copies to the GPU; docs/tensor_parallel.md)."""
        message = self._receive_buffer(self.size)
        self._receive(message)
        head = message.numpy()
        n, next_size = (int(v) for v in head[:HEADER_BYTES].view("<u8"))
        k = min(n, self.size - HEADER_BYTES)
        self.size = next_size
        if n == k:
            return self._decoder.decode(head[HEADER_BYTES : HEADER_BYTES + n])
        rest = self._rest(n - k)
        dist.broadcast(rest, src=0, group=self.group)
        return decode_plan(head[HEADER_BYTES : HEADER_BYTES + k].tobytes() + rest.numpy().tobytes())

    def _receive(self, data: torch.Tensor) -> None:
        if not self.spin_s:
            dist.broadcast(data, src=0, group=self.group)
            return
        work = dist.broadcast(data, src=0, group=self.group, async_op=True)
        deadline = time.perf_counter() + self.spin_s
        while not work.is_completed() and time.perf_counter() < deadline:
            pass
        work.wait()  # (raises what the broadcast raised)

    def _next_size(self, n: int) -> int:
        """The agreed size while this plan fits it and fills more than half of it, else the
        plan's size plus 1/16, rounded up to 4 KiB."""
        need = n + HEADER_BYTES
        if need <= self.size and 2 * need > self.size:
            return self.size
        return max(self.min_bytes, -(-(need + need // 16) // 4096) * 4096)

    def _receive_buffer(self, size: int) -> torch.Tensor:
        self._received = _at_least(self._received, size)
        return self._received[:size]

    def _message(self, size: int) -> torch.Tensor:
        if self.buffer.numel() < size:
            self.buffer = torch.zeros(size, dtype=torch.uint8)
        return self.buffer[:size]

    def _rest(self, n: int) -> torch.Tensor:
        self.rest = _at_least(self.rest, n)
        return self.rest[:n]


def _at_least(buffer: torch.Tensor, n: int) -> torch.Tensor:
    """buffer, or a new one of the next power of two >= n bytes when buffer is smaller."""
    if buffer.numel() >= n:
        return buffer
    return torch.zeros(1 << (n - 1).bit_length(), dtype=torch.uint8)


def shutdown_distributed() -> None:
    """Leave the process groups; NCCL's are left to process exit (a rank already gone would
    leave the others waiting in a collective destroy)."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        return
    dist.destroy_process_group()
