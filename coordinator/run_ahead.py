"""Asynchronous scheduling: a decode step launched before its predecessor's tokens are home.

One plain decode step stays in flight (`AheadStep`): its ids are sampled on the device, and the
next step, scheduled from arrays, takes them as input before the host waits for them. A row
that finished in the step before is wasted compute and its token dropped. The contract is in
docs/async_scheduling.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tapserve.api.sampling_params import BatchDraw
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
    """Device-to-host copies of sampled ids without a sync, through two pinned buffers used in
    turn; on the CPU the ids are already home."""

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
class AheadRows:
    """A launched step's ALL_GENERATED rows: their sequences and positions, and the handler's
    output on its way to the host (or why the handler failed)."""

    seqs: list
    positions: list[int]
    pending: object | None  # handler_rows.PendingRows
    error: str | None = None
    follows: int = -1  # its batch's ScheduledBatch.follows


@dataclass
class AheadStep:
    """A launched decode step whose host work waits for the next step's launch."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # int64 [rows] on the device: the next step's input ids
    pending: PendingTokens
    draw: BatchDraw  # a fast draw (ahead_draw)
    row_params: list | None  # per row: temperatures (TEMPERATURE), SamplingParams (PLAIN)
    num_finished_at_launch: int  # the engine's finish count then: unchanged, every row runs
    generated: AheadRows | None = None  # its ALL_GENERATED rows


def ahead_draw(batch: ScheduledBatch) -> BatchDraw | None:
    """How a plain decode batch's tokens are drawn on the device (GREEDY, TEMPERATURE, or PLAIN
    for a mix); None when some row may not run ahead or the batch is not plain decode."""
    if not batch.all_plain_rows:
        return None
    general = BatchDraw.GENERAL
    draws = {s.request.batch_draw if s.request.runs_ahead else general for s in batch.seqs}
    if general in draws:
        return None
    return draws.pop() if len(draws) == 1 else BatchDraw.PLAIN


def row_params(draw: BatchDraw, seqs: list) -> list | None:
    """What the draw needs per row (AheadStep.row_params)."""
    if draw is BatchDraw.TEMPERATURE:
        return [s.request.params.temperature for s in seqs]
    if draw is BatchDraw.PLAIN:
        return [s.request.params for s in seqs]
    return None
