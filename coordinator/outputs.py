"""A request's wire output after a step: its sequences' news since the last output."""
from __future__ import annotations

from api.wire import RequestOutput, SequenceOutput
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
