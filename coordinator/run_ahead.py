"""Asynchronous scheduling: a decode step launched before its predecessor's tokens are home.

A synchronous step leaves the GPU idle while the host waits for the sampled ids, appends
them, checks stops, builds the outputs and plans the next step. The engine instead
keeps one plain decode step in flight (`AheadStep`): its ids are sampled on the device and
copied to pinned memory, and the next step is scheduled from the scheduler's arrays
(`Scheduler.schedule_ahead`), which need no token, and launched with those ids as its input
(`ModelRunner.execute(..., input_ids=)`; at TP > 1 its plan goes out first, and every rank
takes the ids from a broadcast from rank 0: `StepPlan.ids_from_rank0`). Only then does the
host wait for the first step's ids and do its work, while the GPU runs the second.

A sequence that finishes in a step was already scheduled into the next one: that row's
compute is wasted (it writes the KV of the sequence's last token, in the slot after its
computed ones, in a block it owned and that no prefix-cache entry covers) and its token is
dropped. Anything the arrays cannot schedule (a request to admit, a preemption, a non-plain
row) drains the pipeline: the in-flight step is finished, and the next engine step takes
the general pass. docs/async_scheduling.md has the whole contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tapserve.coordinator.scheduled_batch import ScheduledBatch


class PendingTokens:
    """A step's sampled ids on their way to the host."""

    def __init__(self, host: torch.Tensor, ready: torch.cuda.Event | None):
        self.host, self.ready = host, ready

    def wait(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class TokenCopies:
    """Device-to-host copies of sampled ids without a sync: two pinned buffers used in turn
    (one step's copy may still be running while the host reads the step before), each with
    its event. On the CPU the ids are already home."""

    def __init__(self, rows: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self._buffers = [
            torch.empty(rows, dtype=torch.int64, pin_memory=self.cuda)
            for _ in range(2 if self.cuda else 0)
        ]
        self._events = [torch.cuda.Event() for _ in self._buffers]
        self._turn = 0

    def start(self, tokens: torch.Tensor) -> PendingTokens:
        if not self.cuda:
            return PendingTokens(tokens, None)
        host, ready = self._buffers[self._turn][: tokens.shape[0]], self._events[self._turn]
        self._turn ^= 1
        host.copy_(tokens, non_blocking=True)
        ready.record()
        return PendingTokens(host, ready)


@dataclass
class AheadStep:
    """A launched decode step whose host work waits for the next step's launch."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # int64 [rows] on the device: the next step's input ids
    pending: PendingTokens
    draw: str  # "greedy", "temperature" or "plain" (ahead_draw)
    row_params: list | None  # per row: temperatures ("temperature"), SamplingParams ("plain")
    num_finished_at_launch: int  # the engine's finish count then: unchanged, every row runs


def ahead_draw(batch: ScheduledBatch) -> str | None:
    """How a plain decode batch's tokens are drawn on the device, as Engine._draw_batch
    draws them: "greedy" or "temperature" when every row draws so, "plain" for any other mix
    of batch draws (Sampler.sample_plain); None when some row may not run ahead
    (Request.runs_ahead) or the batch is not a plain decode batch."""
    if not batch.all_plain_rows:
        return None
    draws = {s.request.batch_draw if s.request.runs_ahead else "" for s in batch.seqs}
    if "" in draws:
        return None
    return draws.pop() if len(draws) == 1 else "plain"


def row_params(draw: str, seqs: list) -> list | None:
    """What the draw needs per row (AheadStep.row_params)."""
    if draw == "temperature":
        return [s.request.params.temperature for s in seqs]
    if draw == "plain":
        return [s.request.params for s in seqs]
    return None
