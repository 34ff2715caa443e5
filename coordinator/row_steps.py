"""Rank 0's side of multi-row selections after a step's handler call: prompt rows to their
request, generated-token rows to their sequence, and the head's should_stop (DESIGN.md
"Custom outputs over many tokens")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tapserve.api.wire import EXECUTION_EXCEPTION, Outputs, RequestOutput
from tapserve.coordinator.beam_search import BeamState, Hypothesis, length_normalized
from tapserve.coordinator.custom_outputs import CustomOutputStats, encode_row
from tapserve.coordinator.engine_tokens import TokenSteps
from tapserve.coordinator.handler_rows import HostRows
from tapserve.coordinator.run_ahead import AheadRows
from tapserve.coordinator.sequence import Request, SeqStatus, Sequence

CONTENT_FILTER = "content_filter"  # OpenAI's finish_reason for a head-driven stop


class RowSteps:
    """Places a step's rows of multi-row requests and finishes the sequences they end."""

    def __init__(
        self,
        tokens: TokenSteps,
        stats: CustomOutputStats,
        fail: Callable[[Request, int, str], None],
    ):
        """fail(request, code, message): the engine's, to end a request with an error."""
        self.tokens, self.stats, self.fail = tokens, stats, fail
        self._ended: list[Request] = []  # requests whose sequences these rows ended
        self._steady: _SteadyRows | None = None
        self._bulk_ids: list[str] | None = None  # the last place_ahead's, if it sent in bulk

    @staticmethod
    def stop_rows(seqs: list[Sequence], positions: list[int]) -> list[int]:
        """The step's ALL_GENERATED rows (indices into the step's custom rows): those
        should_stop sees."""
        return [
            i
            for i, (seq, p) in enumerate(zip(seqs, positions))
            if seq.request.all_generated and p >= seq.num_prompt_tokens
        ]

    def place(
        self,
        host: HostRows,
        seqs: list[Sequence],
        positions: list[int],
        multi: list[int],
        stop_rows: list[int],
        columns: Outputs | None = None,
    ) -> int:
        """Give rows `multi` (indices into the step's custom rows) to their requests and
        sequences; apply should_stop's answers for `stop_rows`; finish the sequences whose
        last token was scored. columns (a run-ahead step's, whose rows are single requests
        without logprobs): a sequence's plain next row leaves at once with its token in the
        outputs' row columns (wire.Outputs). Returns how many rows left that way."""
        self._ended = []
        flagged: set[int] = set()
        if stop_rows and host.stop_error is not None:
            self._fail_all(seqs, stop_rows, f"custom output should_stop failed: {host.stop_error}")
        elif host.stops is not None:
            flagged = {stop_rows[k] for k in host.stops.nonzero()[0].tolist()}
        array, dtype = host.array, host.dtype
        fast: list[int] = []
        for i in multi:
            seq, position = seqs[i], positions[i]
            request = seq.request
            if request.error_code is not None or seq.is_finished:
                continue
            if position < seq.num_prompt_tokens:
                request.prompt_rows.add(position, array[i], dtype)
                request.next_prompt_row += 1
            elif not request.all_generated:
                seq.rows.add(position, array[i], dtype)
            elif position == seq.num_prompt_tokens + seq.num_scored:  # (each row once)
                if columns is not None and i not in flagged and _next_row_is_plain(seq, position):
                    fast.append(i)
                    seq.num_emitted_tokens += 1
                else:
                    seq.rows.add(position, array[i], dtype)
                seq.num_scored += 1
        for i in sorted(flagged):
            self._flag(seqs[i], positions[i])
        for i in multi:
            seq = seqs[i]
            if seq.scoring_reason is not None and positions[i] == seq.num_tokens - 1:
                self._finish_scored(seq)
        if fast:
            picked = array if len(fast) == len(array) else array[fast]
            ids = [seqs[i].request.request_id for i in fast]
            tokens = [seqs[i].token_ids[positions[i]] for i in fast]
            self._send_in_columns(columns, ids, tokens, [positions[i] for i in fast], picked, dtype)
        return len(fast)

    def place_ahead(self, rows: AheadRows, columns: Outputs) -> tuple[list[Request], int]:
        """A run-ahead step's ALL_GENERATED rows, now home (each its sequence's newest scored
        token); those of sequences that finished since the launch are dropped. Returns the
        requests these rows ended (closing rows, should_stop, 606s: they need an output), and
        how many rows left in the row columns."""
        seqs, every = rows.seqs, list(range(len(rows.seqs)))
        self._ended = []
        steady, self._steady, self._bulk_ids = self._steady, None, None
        sent = 0
        if rows.error is not None:
            self._fail_all(seqs, every, f"custom output processor failed: {rows.error}")
        else:
            host = rows.pending.wait()
            plain = host.stops is None or not host.stops.any()
            if plain and steady is not None and steady.next_of(rows, self.tokens.num_finished):
                self._bulk_ids = steady.request_ids
                self._send_in_bulk(columns, rows, host, steady.request_ids, steady.tokens)
                sent = len(seqs)
            elif plain and all(map(_next_row_is_plain, seqs, rows.positions)):
                self._bulk_ids = [seq.request.request_id for seq in seqs]
                tokens = [seq.token_ids[p] for seq, p in zip(seqs, rows.positions)]
                self._send_in_bulk(columns, rows, host, self._bulk_ids, tokens)
                sent = len(seqs)
            else:
                sent = self.place(host, seqs, rows.positions, every, every, columns)
        ended, self._ended = self._ended, []
        return list(dict.fromkeys(ended)), sent

    def note_steady(self, serial: int, tokens: list[int]) -> None:
        """The run-ahead step of batch `serial` sent every row in bulk and gave each sequence
        a plain token (`tokens`, in row order) and nothing finished: the next step's rows,
        if its batch follows this one unchanged, are plain too (their tokens are these).
        Remembered only when the last place_ahead sent its rows in bulk (their request ids
        are the next step's)."""
        if self._bulk_ids is not None:
            self._steady = _SteadyRows(serial, self.tokens.num_finished, tokens, self._bulk_ids)

    def _send_in_bulk(
        self,
        columns: Outputs,
        rows: AheadRows,
        host: HostRows,
        request_ids: list[str],
        tokens: list[int],
    ) -> None:
        """Every row is its sequence's plain next row: all leave in the row columns."""
        for seq in rows.seqs:
            seq.num_scored += 1
            seq.num_emitted_tokens += 1
        self._send_in_columns(columns, request_ids, tokens, rows.positions, host.array, host.dtype)

    def _send_in_columns(
        self,
        columns: Outputs,
        request_ids: list[str],
        tokens: list[int],
        positions: list[int],
        rows: np.ndarray,
        dtype: str,
    ) -> None:
        """Each request's token at its position, with its row (rows, in order), into the
        outputs' row columns."""
        columns.row_request_ids.extend(request_ids)
        columns.row_token_ids.extend(tokens)
        columns.row_positions.extend(positions)
        columns.rows = encode_row(rows, dtype)
        self.stats.rows_sent += len(tokens)
        self.stats.bytes_sent += len(columns.rows["data"])

    def _fail_all(self, seqs: list[Sequence], rows: list[int], message: str) -> None:
        """606 for the running requests of these rows."""
        for request in {seqs[i].request: None for i in rows if not seqs[i].is_finished}:
            if request.error_code is None:
                self.fail(request, EXECUTION_EXCEPTION, message)
                self._ended.append(request)

    def _flag(self, seq: Sequence, position: int) -> None:
        """End seq at the token at `position`: "content_filter"; later tokens discarded."""
        if seq.is_finished or seq.request.error_code is not None:
            return
        if seq.request.params.num_beams > 1:
            self._flag_beam(seq)
            return
        kept = position + 1 - seq.num_prompt_tokens  # output tokens, the flagged one included
        del seq.token_ids[position + 1 :]
        del seq.logprobs[kept:]
        del seq.top_logprobs[kept:]
        seq.flagged, seq.scoring_reason = True, None
        self.stats.content_filter += 1
        self.tokens.finish_seq(seq, CONTENT_FILTER)
        self._ended.append(seq.request)

    def _flag_beam(self, seq: Sequence) -> None:
        """A flagged beam (its newest token's row) ends as a finished hypothesis without that
        token; a flagged fork scoring a hypothesis makes it one."""
        request, hypothesis = seq.request, seq.hypothesis
        if hypothesis is None:
            p = request.params
            score = length_normalized(
                seq.cumulative_logprob, seq.num_output_tokens, p.length_penalty
            )
            hypothesis = Hypothesis(score, seq.output_token_ids[:-1], CONTENT_FILTER)
            state = request.beam_state = request.beam_state or BeamState()
            state.finished = sorted([*state.finished, hypothesis], key=lambda h: -h.score)
            del state.finished[p.num_beams :]
        else:
            hypothesis.token_ids = hypothesis.token_ids[:-1]
            hypothesis.finish_reason = CONTENT_FILTER
        hypothesis.rows = seq.rows.copy()
        seq.flagged, seq.scoring_reason = True, None
        self.stats.content_filter += 1
        self.tokens.finish_seq(seq, CONTENT_FILTER, emit=seq.hypothesis is None)
        self._ended.append(request)

    def _finish_scored(self, seq: Sequence) -> None:
        """A finishing sequence's last token has its row: it really finishes now."""
        if seq.is_finished:
            return
        if seq.hypothesis is not None:  # a fork scoring a finished beam
            seq.hypothesis.rows = seq.rows.copy()
        self.tokens.finish_seq(seq, seq.scoring_reason, emit=seq.hypothesis is None)
        self._ended.append(seq.request)

    def count_sent(self, output: RequestOutput) -> None:
        """Add an output's rows and bytes to the metrics."""
        values = [(output.custom_rows, output.custom_positions)] + [
            (s.custom_rows, s.custom_positions) for s in output.sequences
        ]
        for value, positions in values:
            if value is not None:
                self.stats.rows_sent += len(positions)
                self.stats.bytes_sent += len(value["data"])


def _next_row_is_plain(seq: Sequence, position: int) -> bool:
    """seq's row at position may leave at once with its token in the row columns: it is the
    running sequence's next row, every earlier token was sent, nothing else waits for an
    output and it is not finishing."""
    scored = seq.num_scored
    return (
        seq.status is SeqStatus.RUNNING
        and seq.num_emitted_tokens == scored
        and position == seq.num_prompt_tokens + scored
        and seq.scoring_reason is None
        and not seq.rows.positions
        and seq.request.error_code is None
    )


@dataclass
class _SteadyRows:
    """RowSteps.note_steady's memory: the batch, the engine's finish count then, the tokens
    its sequences gained and their request ids (the next step's rows')."""

    serial: int
    num_finished: int
    tokens: list[int]
    request_ids: list[str]

    def next_of(self, rows: AheadRows, num_finished: int) -> bool:
        """rows are the next step's of this batch, unchanged, and nothing finished since."""
        return rows.follows == self.serial and num_finished == self.num_finished
