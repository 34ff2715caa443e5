"""FCFS continuous batching with a per-step token budget, chunked prefill and preemption.

Each step the scheduler first serves running sequences (one token for a decoding sequence,
the next chunk for a prefilling one), then admits waiting requests in arrival order while
sequences, tokens and KV blocks allow. When a running sequence needs a block and none is
free, the most recently arrived running request is preempted: its blocks are freed and it
is recomputed later (its prefix may come back from the prefix cache).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from coordinator.blocks import BlockManager
from coordinator.sequence import Request, Sequence, SeqStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass
class ScheduledBatch:
    """Sequences of one step and how many new tokens each computes, in packed order."""
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 and s.num_computed_tokens == s.num_tokens - 1
                   for s, n in zip(self.seqs, self.num_new_tokens))

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        self._admit_waiting(batch, budget)
        return batch

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free_sequence(seq)

    def drop_waiting(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)

    # ---- internals -----------------------------------------------------------------
    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self._reserve_block(seq, batch):
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return budget

    def _reserve_block(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Ensure seq has a slot for its newest token, preempting later requests if needed."""
        while not self.blocks.can_append([seq]):
            victim = max((s.request for s in self.running), key=lambda r: r.arrival_order)
            self._preempt(victim, batch)
            if victim is seq.request:
                return False
        self.blocks.append_slot(seq)
        return True

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        for seq in request.live_sequences:
            if seq in batch.seqs:
                i = batch.seqs.index(seq)
                del batch.seqs[i], batch.num_new_tokens[i]
            if seq in self.running:
                self.running.remove(seq)
            self.blocks.free_sequence(seq)
            seq.status = SeqStatus.WAITING
            seq.num_computed_tokens = 0
        self.waiting.appendleft(request)
        batch.preempted.append(request)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            seqs = [s for s in request.live_sequences if s.status is SeqStatus.WAITING]
            if len(self.running) + len(seqs) > self.config.max_num_seqs:
                break
            if len(seqs) > 1 and sum(s.num_tokens for s in seqs) > budget:
                break  # several sequences of one request are recomputed in the same step
            if not self._can_allocate(seqs, request):
                break
            self.waiting.popleft()
            for seq in seqs:
                budget = self._start(seq, request, batch, budget)

    def _can_allocate(self, seqs: list[Sequence], request: Request) -> bool:
        need = sum(self.blocks.blocks_needed(s.num_tokens) for s in seqs)
        if len(seqs) == 1:
            return self.blocks.can_allocate(seqs[0], request.reuse_cap_tokens)
        return need <= self.blocks.num_free_blocks

    def _start(self, seq: Sequence, request: Request, batch: ScheduledBatch, budget: int) -> int:
        cached = self.blocks.allocate(seq, request.reuse_cap_tokens)
        if seq is request.sequences[0] and not request.forked:
            request.num_cached_tokens = cached
            if 0 <= request.custom_position < cached and request.custom_output is None:
                request.custom_output_skipped = True
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        return budget - n
