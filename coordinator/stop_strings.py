"""Stop strings on rank 0, for sequences whose last generated token is scored.

LAST_GENERATED must score the last token kept after the cut, so rank 0 detects those stop
strings with the API's own detokenizer and rules, truncates the sequence and scores its last
kept token in the next step (docs/custom_output.md).
"""

from __future__ import annotations

from tapserve.api.detokenizer import Decoder, IncrementalDetokenizer, StopChecker, prompt_context
from tapserve.coordinator.sequence import Request, Sequence


def watches_stop_strings(request: Request, decoder: Decoder | None) -> bool:
    """Whether rank 0 must detect this request's stop strings (see the module docstring)."""
    return decoder is not None and bool(request.params.stop) and request.scores_generated


def kept_output_tokens(
    seq: Sequence, decoder: Decoder, final: bool = False, left_out: int = 0
) -> int | None:
    """Feed seq's new output tokens to its detokenizer; once a stop string matched, the number
    of output tokens to keep, else None. final: the sequence ends here (held characters are
    flushed). left_out: the last tokens whose text the API leaves out, not fed."""
    detok = seq.stop_detokenizer
    if detok is None:  # first call, or a fresh fork: start from all of its output so far
        p = seq.request.params
        detok = seq.stop_detokenizer = IncrementalDetokenizer(
            decoder,
            seq.token_ids[: seq.num_prompt_tokens],
            p.skip_special_tokens,
            StopChecker(p.stop, p.include_stop_str_in_output, p.min_tokens),
        )
    end = len(seq.token_ids) - left_out
    detok.add_tokens(seq.token_ids[seq.num_prompt_tokens + detok.num_tokens : end])
    if final:
        detok.finish()
    if not detok.stopped:
        return None
    return _fewest_tokens_for(seq, decoder, detok.text, detok.kept_tokens)


def _fewest_tokens_for(seq: Sequence, decoder: Decoder, kept_text: str, upper: int) -> int:
    """The fewest output tokens, at most upper, whose text starts with kept_text."""
    p, skip = seq.num_prompt_tokens, seq.request.params.skip_special_tokens
    context = prompt_context(decoder, seq.token_ids[:p])  # as the detokenizer's window
    skipped = len(decoder.decode(context, skip))
    k = upper
    while k > 0 and decoder.decode(context + seq.token_ids[p : p + k - 1], skip)[
        skipped:
    ].startswith(kept_text):
        k -= 1
    return k


def truncate_output(seq: Sequence, kept: int) -> None:
    """Drop output tokens after the first `kept` (> 0), and their logprobs; the last kept token
    is computed again in the scoring step."""
    del seq.token_ids[seq.num_prompt_tokens + kept :]
    del seq.logprobs[kept:]
    del seq.top_logprobs[kept:]
    seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids) - 1)
    seq.num_scored = min(seq.num_scored, kept)
    seq.rows.drop_from(seq.num_prompt_tokens + kept)
