"""A request's wire output after a step: its sequences' news since the last output."""

from __future__ import annotations

from tapserve.api.wire import Outputs, RequestOutput, SequenceOutput
from tapserve.coordinator.beam_search import BeamSearch
from tapserve.coordinator.scheduled_batch import ScheduledBatch
from tapserve.coordinator.sequence import Request, SeqStatus, Sequence


def request_output(request: Request, beams: BeamSearch) -> RequestOutput:
    """request's output after a step (built per running request per step: keep it lean)."""
    seqs = request.sequences
    finished = seqs[0].status is SeqStatus.FINISHED if len(seqs) == 1 else request.is_finished
    params = request.params
    if params.max_new_tokens == 0:  # scoring only: n empty sequences, one value
        reason = seqs[0].finish_reason
        outs = [
            SequenceOutput(index=i, finish_reason=reason, cumulative_logprob=0.0)
            for i in range(params.n)
        ]
    elif params.num_beams > 1:  # beams are sent once, when done: the best n of them
        outs = beams.final_outputs(request) if finished else []
    else:
        outs = [sequence_output(s, params.logprobs) for s in seqs]
    # positional, in RequestOutput's field order
    output = RequestOutput(
        request.request_id,
        True,
        outs,
        finished,
        request.custom_output,
        request.error_code,
        request.error_message,
        len(request.prompt_token_ids),
        request.num_cached_tokens,
    )
    if request.custom_output_skipped:  # its selected prompt token came from the prefix cache
        output.custom_output_omitted = "prefix_reuse"
    if request.prompt_rows:
        output.custom_rows, output.custom_positions = request.prompt_rows.take()
    return output


def sequence_output(seq: Sequence, with_logprobs: bool) -> SequenceOutput:
    """seq's output tokens (and logprobs) not sent yet, marked sent: with ALL_GENERATED those
    whose rows are computed; a multi-row selection's rows not sent yet with them (once
    flagged, the flagged token's row alone)."""
    start, end = seq.num_emitted_tokens, seq.num_sendable
    seq.num_emitted_tokens = end
    first = seq.num_prompt_tokens
    # positional, in SequenceOutput's field order
    out = SequenceOutput(
        seq.index,
        seq.token_ids[first + start : first + end],
        seq.logprobs[start:end] if with_logprobs else None,
        seq.top_logprobs[start:end] if with_logprobs else None,
        seq.finish_reason,
        seq.cumulative_logprob,
        seq.custom_output,
    )
    if seq.rows:
        out.custom_rows, out.custom_positions = seq.rows.take()
    return out


def put_news_in_columns(seqs: list[Sequence], outputs: Outputs) -> tuple[list[Request], bool]:
    """Put the step's plain decode news into outputs' columns (marked sent); returns the other
    requests the step touched, once each, in order (they need a full RequestOutput), and
    whether an every-generated-token sequence held back its newest token (news to come)."""
    request_ids, new_tokens = outputs.token_request_ids, outputs.new_token_ids
    full: dict[Request, None] = {}  # insertion-ordered set
    held = False
    running = SeqStatus.RUNNING  # a local: an enum member lookup costs ~0.2 µs per use
    for seq in seqs:
        request, token_ids, emitted = seq.request, seq.token_ids, seq.num_emitted_tokens
        news_end = seq.num_prompt_tokens + emitted + 1
        if (
            request.token_columns
            and emitted
            and seq.status is running
            and len(token_ids) == news_end
        ):
            request_ids.append(request.request_id)
            new_tokens.append(token_ids[-1])
            seq.num_emitted_tokens = emitted + 1
        elif request.all_generated and holds_only_its_newest(seq, news_end):
            held = True  # its newest token leaves with its row, in a later step
        else:
            full[request] = None
    return list(full), held


def holds_only_its_newest(seq: Sequence, news_end: int) -> bool:
    """An every-generated-token sequence has nothing to send but its newest token, which
    waits for its row (news_end: its prompt, the tokens sent and one more; a sequence that
    finishes with that token sends it with its closing row)."""
    return (
        seq.status is SeqStatus.RUNNING
        and len(seq.token_ids) == news_end
        and seq.num_scored == seq.num_emitted_tokens
        and not seq.rows.positions
        and not seq.request.prompt_rows.positions
    )


class SteadyColumns:
    """put_news_in_columns with a memory: a steady step following a batch whose news all went
    into the columns puts its news there without looking at each request."""

    def __init__(self) -> None:
        self._serial = -1  # the last batch whose news all went into the columns
        self._ids: list[str] | None = None  # its rows' request ids, once needed

    def reset(self) -> None:
        """Forget the last batch: the next one's news goes through put_news_in_columns."""
        self._serial, self._ids = -1, None

    def put(
        self, batch: ScheduledBatch, tokens: list[int] | None, outputs: Outputs
    ) -> list[Request]:
        """tokens: each row's one new token when every row gained exactly that, else None.
        Returns the requests that need a full RequestOutput, as put_news_in_columns."""
        if tokens is not None and batch.follows == self._serial >= 0:
            if self._ids is None:
                self._ids = [s.request.request_id for s in batch.seqs]
            outputs.token_request_ids.extend(self._ids)
            outputs.new_token_ids.extend(tokens)
            for seq in batch.seqs:
                seq.num_emitted_tokens += 1
            self._serial = batch.serial
            return []
        full, held = put_news_in_columns(batch.seqs, outputs)
        self._serial, self._ids = (-1 if full or held else batch.serial), None
        return full
