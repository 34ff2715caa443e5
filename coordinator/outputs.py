"""A request's wire output after a step: its sequences' news since the last output."""
from __future__ import annotations

from api.wire import Outputs, RequestOutput, SequenceOutput
from coordinator.beam_search import BeamSearch
from coordinator.sequence import Request, Sequence, SeqStatus


def request_output(request: Request, beams: BeamSearch) -> RequestOutput:
    """Built for every request a step touched, once per running request per step: keep it
    lean (positional dataclass construction, no per-sequence work beyond the news)."""
    seqs = request.sequences
    finished = seqs[0].status is SeqStatus.FINISHED if len(seqs) == 1 else request.is_finished
    params = request.params
    if params.max_new_tokens == 0:  # scoring only: n empty sequences, one value
        reason = seqs[0].finish_reason
        outs = [SequenceOutput(index=i, finish_reason=reason, cumulative_logprob=0.0)
                for i in range(params.n)]
    elif params.num_beams > 1:  # beams are sent once, when done: the best n of them
        outs = beams.final_outputs(request) if finished else []
    else:
        outs = [sequence_output(s, params.logprobs) for s in seqs]
    # positional: RequestOutput's field order (request_id, accepted, sequences, finished,
    # custom_output, error_code, error_message, num_prompt_tokens, num_cached_tokens)
    return RequestOutput(request.request_id, True, outs, finished, request.custom_output,
                         request.error_code, request.error_message,
                         len(request.prompt_token_ids), request.num_cached_tokens)


def sequence_output(seq: Sequence, with_logprobs: bool) -> SequenceOutput:
    """seq's output tokens (and logprobs) not sent yet; marks them sent."""
    start = seq.num_emitted_tokens
    token_ids = seq.token_ids
    seq.num_emitted_tokens = len(token_ids) - seq.num_prompt_tokens
    # positional: SequenceOutput's field order (index, new_token_ids, new_logprobs,
    # new_top_logprobs, finish_reason, cumulative_logprob, custom_output)
    return SequenceOutput(seq.index, token_ids[seq.num_prompt_tokens + start:],
                          seq.logprobs[start:] if with_logprobs else None,
                          seq.top_logprobs[start:] if with_logprobs else None,
                          seq.finish_reason, seq.cumulative_logprob, seq.custom_output)


def put_news_in_columns(seqs: list[Sequence], outputs: Outputs) -> list[Request]:
    """The step's usual decode news, one new token of a running token_columns request past its
    first, goes into outputs' columns (marked sent); returns the other requests the step
    touched, once each, in order: they need a full RequestOutput."""
    request_ids, new_tokens = outputs.token_request_ids, outputs.new_token_ids
    full: dict[Request, None] = {}  # insertion-ordered set
    running = SeqStatus.RUNNING  # a local: an enum member lookup costs ~0.2 µs per use
    for seq in seqs:
        request, token_ids, emitted = seq.request, seq.token_ids, seq.num_emitted_tokens
        if (request.token_columns and emitted and seq.status is running
                and len(token_ids) == seq.num_prompt_tokens + emitted + 1):
            request_ids.append(request.request_id)
            new_tokens.append(token_ids[-1])
            seq.num_emitted_tokens = emitted + 1
        else:
            full[request] = None
    return list(full)
