"""FCFS continuous batching with a per-step token budget, chunked prefill and preemption.

Running sequences are served first, then waiting requests are admitted in arrival order while
sequences, tokens and KV blocks allow. When a block runs short, the most recently arrived
running sequence (a beam request's beams together) is preempted and recomputed later. A steady
decode step is scheduled from arrays kept across steps (docs/async_scheduling.md).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

from tapserve.coordinator.blocks import BlockManager
from tapserve.coordinator.scheduled_batch import ScheduledBatch, is_special_row
from tapserve.coordinator.sequence import Request, SeqStatus, Sequence


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        self._steady: _SteadyRows | None = None  # the last batch, if note_advanced saw it
        self._serial = 0  # ScheduledBatch.serial of the last batch
        self.num_steady_steps = 0  # steps scheduled from _SteadyRows (a statistic)
        self._wide: dict[int, Request] = {}  # admitted requests that may run > 1 sequence

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        steady, self._steady = self._steady, None
        self._serial += 1
        if (
            steady is not None
            and steady.tokens is not None
            and not self._may_admit()
            and self.running == steady.seqs
        ):
            batch = self._schedule_steady(steady)
            if batch is not None:
                return batch
        batch = ScheduledBatch(serial=self._serial)
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        self._admit_waiting(batch, budget)
        return batch

    def note_advanced(self, batch: ScheduledBatch, tokens: list[int] | None) -> None:
        """The engine's word that batch was a plain decode step of every running sequence and
        each has since gained exactly its sampled token (tokens, in row order): the next step
        may come from arrays. tokens None: still on the device; only schedule_ahead may use it."""
        if batch.all_plain_rows:
            self._steady = _SteadyRows(
                batch.seqs,
                np.array(batch.context_lens, np.int64),
                batch.block_capacities,
                batch.table_stamps,
                tokens,
                batch.serial,
            )

    def schedule_ahead(self) -> tuple[ScheduledBatch, np.ndarray | None] | None:
        """The next decode step, from arrays, of the rows still running in the batch noted with
        note_advanced(batch, None); returns it and, when rows were dropped, the kept rows'
        indices (int64). None when the general pass is needed: nothing was touched, the noted
        batch is forgotten, and the step in flight must finish before schedule()."""
        steady, self._steady = self._steady, None
        if steady is None or steady.tokens is not None or self._may_admit():
            return None
        keep = None
        if self.running != steady.seqs:
            kept = [i for i, s in enumerate(steady.seqs) if s.status is SeqStatus.RUNNING]
            if not kept or [steady.seqs[i] for i in kept] != self.running:
                return None
            keep = np.array(kept, np.int64)
            steady = steady.subset(keep)
        self._serial += 1
        batch = self._schedule_steady(steady)
        if batch is None:
            return None
        if keep is not None:  # other rows than the last plan's: the planner builds anew
            batch.follows = -1
        return batch, keep

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free_sequence(seq)

    def drop_waiting(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)

    # ---- internals -----------------------------------------------------------------
    def _may_admit(self) -> bool:
        """Whether the general pass would admit the first waiting request now; a False never
        leaves waiting a request that the general pass would admit."""
        if not self.waiting or len(self.running) >= self.config.max_num_batched_tokens:
            return False
        request = self.waiting[0]
        return self._fits(self._next_admitted(request), request)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        handled: set[Sequence] = set()  # beams scheduled together with an earlier one
        blocks, block_size = self.blocks, self.blocks.block_size
        running = SeqStatus.RUNNING  # a local: an enum member lookup costs ~0.2 µs per use
        # bound methods as locals: ScheduledBatch.add inlined, five appends per row per step
        add_seq, add_count, add_len, add_last, add_stamp = (
            batch.seqs.append,
            batch.num_new_tokens.append,
            batch.context_lens.append,
            batch.last_token_ids.append,
            batch.table_stamps.append,
        )
        special, all_single = False, True
        for seq in list(self.running):  # a copy: preemption removes sequences from running
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted earlier in this loop
            token_ids = seq.token_ids
            num_tokens = len(token_ids)
            if seq.request.single:  # blocks_to_append inlined: no fork shares its last block
                if num_tokens > len(seq.block_table) * block_size and not self._reserve_block(
                    seq, batch
                ):
                    continue
            elif seq.request.params.num_beams > 1 and seq.scoring_reason is None:
                all_single = False
                if seq not in handled:
                    group, forks = self._group(seq), self._scoring_forks(seq.request)
                    handled.update(group)
                    handled.update(forks)
                    budget, scored = self._schedule_forks(forks, batch, budget)
                    if scored and all(self._reserve_block(s, batch) for s in group):
                        budget = self._take_tokens(group, batch, budget)
                continue
            elif seq in handled:
                continue  # a beam's scoring fork, scheduled with its beams
            elif blocks.blocks_to_append(seq) and not self._reserve_block(seq, batch):
                continue
            else:
                all_single = False
            computed = seq.num_computed_tokens
            n = num_tokens - computed
            if n > budget:
                n, batch.partial = budget, True
            add_seq(seq)
            add_count(n)
            add_len(computed + n)
            add_last(token_ids[-1])
            add_stamp(seq.block_table_version)
            if not special and (computed < seq.num_prompt_tokens or seq.scoring_reason is not None):
                special = True  # is_special_row, inlined
            budget -= n
        if batch.preempted:  # a row that set `special` may have been dropped since
            batch.has_special_rows = any(map(is_special_row, batch.seqs))
        else:
            batch.has_special_rows |= special
        batch.all_single &= all_single
        return budget

    def _schedule_steady(self, steady: _SteadyRows) -> ScheduledBatch | None:
        """The next decode step of steady.seqs, or None when it needs the general pass."""
        seqs, n, size = steady.seqs, len(steady.seqs), self.blocks.block_size
        if n > self.config.max_num_batched_tokens:
            return None
        context_lens = steady.context_lens + 1  # each row's tokens now, all in the KV after
        capacities = steady.capacities
        if capacities is None:  # the first steady step after the general pass
            capacities = np.array([len(s.block_table) for s in seqs], np.int64) * size
            if not (capacities - context_lens < size - 1).all():
                return None  # a table holds a block beyond its tokens' (never seen so far)
        # each table holds exactly its KV tokens' blocks: a row needs a block when it grows
        grow = np.flatnonzero(context_lens > capacities)
        if grow.size > self.blocks.num_free_blocks:
            return None
        stamps, new_blocks = list(steady.stamps), []
        for i in grow.tolist():  # a new block to write: never a copy for a single request
            seq = seqs[i]
            self.blocks.append_block(seq)  # (the arrays decide: its newest token may be
            stamps[i] = seq.block_table_version  # still on the device, schedule_ahead)
            new_blocks.append(seq.block_table[-1])
        if grow.size:
            capacities = capacities.copy()
            capacities[grow] += size
        self.num_steady_steps += 1
        return ScheduledBatch(
            list(seqs),
            [1] * n,
            context_lens.tolist(),
            steady.tokens,
            stamps,
            block_capacities=capacities,
            serial=self._serial,
            follows=steady.serial,
            grown_rows=grow,
            grown_cols=(context_lens[grow] - 1) // size,
            grown_blocks=np.array(new_blocks, np.int64),
        )

    def _group(self, seq: Sequence) -> list[Sequence]:
        """The running sequences that advance and are preempted together with seq: all beams
        of a beam request; anything else, a scoring fork included, goes alone."""
        if seq.request.params.num_beams == 1 or seq.scoring_reason is not None:
            return [seq]
        return [s for s in self.running if s.request is seq.request and s.scoring_reason is None]

    def _scoring_forks(self, request: Request) -> list[Sequence]:
        """A beam request's running forks that score finished hypotheses (LAST_GENERATED)."""
        if not request.scores_generated:
            return []
        return [s for s in self.running if s.request is request and s.scoring_reason is not None]

    def _schedule_forks(
        self, forks: list[Sequence], batch: ScheduledBatch, budget: int
    ) -> tuple[int, bool]:
        """Schedule a beam request's scoring forks before its beams; whether all of them were
        (the beams advance only then, or they would fork past Request.max_rows)."""
        for fork in forks:
            if budget == 0 or not self._reserve_block(fork, batch):
                return budget, False
            need = fork.num_tokens - fork.num_computed_tokens  # 1, or a recompute's chunk
            n = min(need, budget)
            batch.add(fork, n)
            budget -= n
            if n < need:
                return budget, False
        return budget, True

    def _reserve_block(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Ensure seq has a slot for its newest token, preempting the most recently arrived
        sequences if needed. False when seq itself was preempted."""
        if not self.blocks.blocks_to_append(seq):
            return True  # the common case: append_slot would change nothing
        while self.blocks.blocks_to_append(seq) > self.blocks.num_free_blocks:
            victim = max(self.running, key=lambda s: (s.request.arrival_order, s.index))
            group = self._group(victim)
            self._preempt(group, batch)
            if seq in group:
                return False
        copy = self.blocks.append_slot(seq)
        if copy is not None:
            batch.block_copies.append(copy)
        return True

    def _preempt(self, seqs: list[Sequence], batch: ScheduledBatch) -> None:
        request = seqs[0].request
        for seq in seqs:
            if seq in batch.seqs:
                batch.drop(seq)
            if seq in self.running:
                self.running.remove(seq)
            self.blocks.free_sequence(seq)
            seq.status = SeqStatus.WAITING
            seq.num_computed_tokens = 0
        if request not in self.waiting:
            self.waiting.appendleft(request)
        batch.preempted.append(request)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            seqs = self._next_admitted(request)
            if not self._fits(seqs, request):
                break
            for seq in seqs:
                self._start(seq, request)
            budget = self._take_tokens(seqs, batch, budget)
            if not any(s.status is SeqStatus.WAITING for s in request.live_sequences):
                self.waiting.popleft()

    @staticmethod
    def _next_admitted(request: Request) -> list[Sequence]:
        """The waiting sequences of request that admission starts together next."""
        seqs = [s for s in request.live_sequences if s.status is SeqStatus.WAITING]
        scoring = [s for s in seqs if s.scoring_reason is not None]
        if scoring:  # preempted while scoring its last token: alone, before the rest
            return scoring[:1]
        if request.params.num_beams == 1:
            return seqs[:1]  # samples of n > 1 are independent: admitted one at a time
        return seqs

    def _take_tokens(self, seqs: list[Sequence], batch: ScheduledBatch, budget: int) -> int:
        """Schedule the next tokens of seqs within the budget; several seqs (beams) either all
        reach their last token in this step or none does."""
        needs = [s.num_tokens - s.num_computed_tokens for s in seqs]
        if len(seqs) > 1 and sum(needs) > budget:
            needs = [n - 1 for n in needs]
        for seq, need in zip(seqs, needs):
            n = min(need, budget)
            if n > 0:
                batch.add(seq, n)
                budget -= n
        return budget

    def _fits(self, seqs: list[Sequence], request: Request) -> bool:
        """Admission's test: their blocks fit and max_num_seqs has room for seqs, or for a
        request that will fork or run beams, for its widest step (Request.max_rows)."""
        need = len(seqs) if request.forked and request.params.num_beams == 1 else request.max_rows
        return self._rows_held() + need <= self.config.max_num_seqs and self._can_allocate(
            seqs, request
        )

    def _rows_held(self) -> int:
        """The running sequences, and the rows their requests may still fork into."""
        held = len(self.running)
        for key, request in list(self._wide.items()):
            if request.is_finished or (request.forked and request.params.num_beams == 1):
                del self._wide[key]  # finished, or its samples are all there: no more forks
                continue
            running = sum(1 for s in request.sequences if s.status is SeqStatus.RUNNING)
            held += max(request.max_rows - running, 0) if running else 0
        return held

    def _can_allocate(self, seqs: list[Sequence], request: Request) -> bool:
        need = sum(self.blocks.blocks_needed(s.num_tokens) for s in seqs)
        if len(seqs) == 1:
            return self.blocks.can_allocate(seqs[0], request.reuse_cap_tokens)
        return need <= self.blocks.num_free_blocks

    def _start(self, seq: Sequence, request: Request) -> None:
        cached = self.blocks.allocate(seq, request.reuse_cap_tokens)
        if seq is request.sequences[0] and not request.forked:
            if not request.admitted:  # (after a preemption its own blocks come back)
                request.num_cached_tokens, request.admitted = cached, True
            if 0 <= request.custom_position < cached and request.custom_output is None:
                request.custom_output_skipped = True
            if request.selection is not None:
                _omit_cached_rows(request, cached)
        if request.max_rows > 1:
            self._wide[id(request)] = request
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)


def _omit_cached_rows(request: Request, cached: int) -> None:
    """Selected prompt positions the prefix cache covered get no row (`omit`; `recompute`
    capped reuse below them)."""
    first_uncached = bisect.bisect_left(request.selection.prompt, cached)
    if first_uncached > request.next_prompt_row:
        request.next_prompt_row = first_uncached
        request.custom_output_skipped = True


@dataclass
class _SteadyRows:
    """A decode batch carried to the next step (Scheduler.note_advanced); capacities are the
    rows' block capacities in tokens, filled on first use."""

    seqs: list[Sequence]
    context_lens: np.ndarray  # int64
    capacities: np.ndarray | None
    stamps: list[int]
    tokens: list[int] | None  # None: still on the device (Scheduler.schedule_ahead)
    serial: int  # the batch's ScheduledBatch.serial

    def subset(self, rows: np.ndarray) -> _SteadyRows:
        """These rows alone (int64 indices, in order)."""
        return _SteadyRows(
            [self.seqs[i] for i in rows.tolist()],
            self.context_lens[rows],
            None if self.capacities is None else self.capacities[rows],
            [self.stamps[i] for i in rows.tolist()],
            None if self.tokens is None else [self.tokens[i] for i in rows.tolist()],
            self.serial,
        )
