"""Request and sequence state on rank 0.

A request starts with one sequence (its prompt). After the prompt's prefill it forks into
`n` samples or `num_beams` beams that share the prompt's KV blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import count

from tapserve.api.sampling_params import BatchDraw, SamplingParams
from tapserve.coordinator.row_selection import LAST_GENERATED, PendingRows, RowSelection


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    index: int = 0  # which of the request's n samples / beams
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # restamped by the block manager on every change of block_table (0: never given blocks)
    block_table_version: int = 0
    block_table_base: int = -1  # the stamp this table extends by appended blocks (-1: none)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_hashed_blocks: int = 0  # leading full blocks registered in the prefix cache
    cumulative_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list]] = field(default_factory=list)
    finish_reason: str | None = None
    num_emitted_tokens: int = 0  # output tokens already sent to the client
    # LAST_GENERATED: the finish reason held back while the last token is scored (it runs one
    # more step, computing that token with no logits), then its value {"dtype", "shape", "data"}
    scoring_reason: str | None = None
    custom_output: dict | None = None
    hypothesis: object | None = None  # beam search: the finished Hypothesis this fork scores
    # rank 0's stop-string detokenizer (coordinator/stop_strings.py), for LAST_GENERATED only
    stop_detokenizer: object | None = field(default=None, repr=False)
    # a multi-row selection: this sequence's generated-token rows not sent yet (a beam's: all
    # of its history), and how many output tokens have their row (ALL_GENERATED)
    rows: PendingRows = field(default_factory=PendingRows, repr=False)
    num_scored: int = 0
    flagged: bool = False  # its last token's row made the head's should_stop fire

    @property
    def num_sendable(self) -> int:
        """Output tokens that may be sent: with ALL_GENERATED, those whose row is computed
        (a flagged token never)."""
        if self.request.all_generated:
            return self.num_scored - self.flagged
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    custom_position: int = -1  # selected prompt token, -1: none, -2: last generated (per sequence)
    # a multi-row selection (the selector returned a list); custom_position stays -1
    selection: RowSelection | None = None
    custom_output_params: dict | None = None  # the request's, for should_stop
    all_generated: bool = False  # selection holds ALL_GENERATED: every generated token's row
    next_prompt_row: int = 0  # selection.prompt[next_prompt_row:] have no row yet
    prompt_rows: PendingRows = field(default_factory=PendingRows, repr=False)  # not sent yet
    reuse_cap_tokens: int | None = None  # prefix reuse must stop below this many tokens
    custom_output: dict | None = None  # {"dtype", "shape", "data"} once computed
    custom_output_skipped: bool = False  # selected token came from the prefix cache (omit)
    sequences: list[Sequence] = field(default_factory=list)
    forked: bool = False  # prompt sequence already split into n samples / beams
    beam_state: object | None = None  # coordinator.beam_search.BeamState for beam search
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave at its first admission
    admitted: bool = False  # its prompt sequence has been admitted once
    # fixed at admission (Engine.add_request), for the per-token checks of the decode loop:
    stop_token_set: frozenset[int] = frozenset()  # tokens that end it (once min_tokens is met)
    max_total_tokens: int = 0  # prompt + max_new_tokens, capped at the model's context
    # its SamplingParams.batch_draw; batch_draw: the one in effect (GENERAL until it forked)
    fast_draw: BatchDraw = BatchDraw.GENERAL
    batch_draw: BatchDraw = BatchDraw.GENERAL
    single: bool = False  # one sequence for good: n = 1, no beams, no engine stop strings
    watch_stop_strings: bool = (
        False  # rank 0 detects its stop strings (coordinator/stop_strings.py)
    )
    token_columns: bool = False  # its plain decode news may travel in wire.Outputs' columns
    # its decode steps may run ahead of their sampling (coordinator/run_ahead.py)
    runs_ahead: bool = False
    error_code: int | None = None
    error_message: str | None = None

    @property
    def scores_generated(self) -> bool:
        """Its sequences get rows of generated tokens: a finishing one computes its last."""
        return self.custom_position == LAST_GENERATED or (
            self.selection is not None and self.selection.generated is not None
        )

    @property
    def max_rows(self) -> int:
        """The most sequences it runs in one step: n samples, or its beams (twice as many when
        forks score finished hypotheses); 1 for scoring only."""
        if self.params.max_new_tokens == 0:
            return 1
        if self.params.num_beams > 1:
            return self.params.num_beams * (2 if self.scores_generated else 1)
        return self.params.n

    @property
    def live_sequences(self) -> list[Sequence]:
        return [s for s in self.sequences if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        for s in self.sequences:
            if s.status is not SeqStatus.FINISHED:
                return False
        return bool(self.sequences)


class SequenceFactory:
    """Hands out sequence ids unique within one engine."""

    def __init__(self) -> None:
        self._ids = count()

    def prompt_sequence(self, request: Request) -> Sequence:
        seq = Sequence(
            next(self._ids), request, list(request.prompt_token_ids), len(request.prompt_token_ids)
        )
        request.sequences.append(seq)
        return seq

    def fork(self, parent: Sequence, index: int) -> Sequence:
        """A copy of parent's state (tokens, logprobs); blocks are shared by the block manager."""
        child = Sequence(
            next(self._ids),
            parent.request,
            list(parent.token_ids),
            parent.num_prompt_tokens,
            index=index,
            status=parent.status,
            num_computed_tokens=parent.num_computed_tokens,
            num_hashed_blocks=parent.num_hashed_blocks,
            cumulative_logprob=parent.cumulative_logprob,
            logprobs=list(parent.logprobs),
            top_logprobs=list(parent.top_logprobs),
            num_emitted_tokens=parent.num_emitted_tokens,
            rows=parent.rows.copy(),
            num_scored=parent.num_scored,
        )
        return child
