"""One step's batch as the scheduler hands it to the planner: its rows, in packed order."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tapserve.coordinator.sequence import Request, Sequence


def is_special_row(seq: Sequence) -> bool:
    """seq's row computes a prompt token or scores its last token (the running loop inlines it)."""
    return seq.num_computed_tokens < seq.num_prompt_tokens or seq.scoring_reason is not None


@dataclass
class ScheduledBatch:
    """Sequences of one step and how many new tokens each computes, in packed order, with the
    per-row lists the planner builds a decode plan from without reading each sequence."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)  # tokens in the KV after this step
    # each sequence's newest token; None while still on the device (Scheduler.schedule_ahead)
    last_token_ids: list[int] | None = field(default_factory=list)
    table_stamps: list[int] = field(default_factory=list)  # block_table_version after appends
    has_special_rows: bool = False
    all_single: bool = True  # every row's request is Request.single (never forks)
    block_capacities: np.ndarray | None = None  # per row, tokens its blocks hold (steady steps)
    # some row computes fewer tokens than it has uncomputed: not decode-shaped
    partial: bool = False
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    serial: int = 0  # this batch's number in the scheduler's count
    # a steady step: the serial of the batch it advances by a token a row (else -1), and the
    # rows that gained a block, the blocks' columns and the blocks (int64)
    follows: int = -1
    grown_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    grown_cols: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    grown_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def all_plain_rows(self) -> bool:
        """Every row single, none special or partial, no copies or preemptions: the next step
        may come from arrays and run ahead of this one's sampling."""
        return (
            self.all_single
            and not self.has_special_rows
            and not self.partial
            and not self.block_copies
            and not self.preempted
        )

    def add(self, seq: Sequence, n: int) -> None:
        """Schedule n new tokens of seq (the running loop inlines this)."""
        computed = seq.num_computed_tokens
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.context_lens.append(computed + n)
        self.last_token_ids.append(seq.token_ids[-1])
        self.table_stamps.append(seq.block_table_version)
        self.partial |= computed + n < seq.num_tokens
        self.has_special_rows |= is_special_row(seq)
        self.all_single &= seq.request.single

    def drop(self, seq: Sequence) -> None:
        """Unschedule seq (preempted after it was scheduled) and recompute the flags."""
        i = self.seqs.index(seq)
        for rows in (
            self.seqs,
            self.num_new_tokens,
            self.context_lens,
            self.last_token_ids,
            self.table_stamps,
        ):
            del rows[i]
        self.partial = any(n < s.num_tokens for s, n in zip(self.seqs, self.context_lens))
        self.has_special_rows = any(map(is_special_row, self.seqs))
