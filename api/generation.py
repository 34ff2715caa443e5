"""One HTTP request's generation state: engine outputs -> per-choice text deltas.

Prompt p's sequence i is the client's choice `p * n + i`. A choice cut by a stop string
ignores later tokens, and a prompt whose choices are all cut is aborted (with
`engine_stop_strings` it waits for the final output instead). Engine errors raise EngineError.
A multi-row custom output (api/custom_rows.py) reaches each choice as its prompt's rows, then
the rows of the tokens it keeps, and for "content_filter" the flagged token's row.
"""

from __future__ import annotations

import time

from tapserve.api import wire
from tapserve.api.choices import Choice, ChoiceDelta, PromptState, merge_deltas
from tapserve.api.custom_rows import Rows, client_fields, join
from tapserve.api.detokenizer import (
    IncrementalDetokenizer,
    StopChecker,
    TextOffsets,
    open_character_bytes,
)
from tapserve.api.engine_client import EngineError, RequestGroup
from tapserve.api.metrics import ApiMetrics
from tapserve.api.sampling_params import SamplingParams
from tapserve.api.tokenizer import TextTokenizer


class Generation:
    """Applies a group's RequestOutputs; `choices()` lists all choices in index order."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        group: RequestGroup,
        prompts: list[tuple[list[int], SamplingParams]],
        metrics: ApiMetrics | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.tokenizer, self.group, self.metrics = tokenizer, group, metrics
        self.eos_token_ids = eos_token_ids
        # as vLLM: the tokenizer's EOS is the only EOS without a stop_reason
        self.primary_eos = tokenizer.eos_token_id
        self.prompts: dict[str, PromptState] = {}
        first = 0
        for rid, (ids, params) in zip(group.request_ids, prompts):
            self.prompts[rid] = PromptState(rid, ids, params, first)
            first += params.n
        self.start_time = time.monotonic()
        self._last_token_time: dict[int, float] = {}  # per client choice (metrics)

    # ---- applying outputs ------------------------------------------------------------
    def apply(self, out: wire.RequestOutput) -> list[ChoiceDelta]:
        """Update from one output; returns the deltas of the choices it touched, in order."""
        state = self.prompts[out.request_id]
        if out.error_code is not None:
            raise EngineError(out.error_code, out.error_message or "request failed")
        if out.custom_output is not None:
            state.set_custom_output(out.custom_output)
        state.num_cached_tokens = out.num_cached_tokens or state.num_cached_tokens
        state.custom_output_omitted = out.custom_output_omitted or state.custom_output_omitted
        prompt_rows = state.add_rows(out.custom_rows, out.custom_positions)
        if prompt_rows is not None:
            state.rows.extend(prompt_rows)
        deltas = [self._apply_sequence(state, s) for s in out.sequences]
        deltas = [d for d in deltas if d is not None]
        if out.finished:
            state.engine_finished = True
            deltas += self._finish_rest(state)
        elif any(d.finish_reason for d in deltas) and state.all_done():
            self.group.abort_one(state.request_id)  # every choice cut by a stop string
        self._observe(deltas)
        return sorted(deltas, key=lambda d: d.index)

    def _choice(self, state: PromptState, seq_index: int) -> Choice:
        if seq_index not in state.choices:
            p = state.params
            detok = IncrementalDetokenizer(
                self.tokenizer,
                state.prompt_ids,
                p.skip_special_tokens,
                StopChecker(p.stop, p.include_stop_str_in_output, p.min_tokens),
            )
            state.choices[seq_index] = Choice(
                state.first_index + seq_index,
                state,
                detok,
                offset_counter=TextOffsets(self._open_prompt_bytes(state.prompt_ids, p)),
            )
        return state.choices[seq_index]

    def _apply_sequence(self, state: PromptState, seq: wire.SequenceOutput) -> ChoiceDelta | None:
        choice = self._choice(state, seq.index)
        if choice.finish_reason is not None:
            return None
        ids, p = seq.new_token_ids, state.params
        # as vLLM, a stop id or EOS ending the sequence leaves its text out but still counts;
        # decided by the token, since a LAST_GENERATED sequence finishes in a later output
        hidden = int(p.hides_last(ids, self.eos_token_ids))
        used = choice.detok.add_tokens(ids[: len(ids) - hidden])
        if hidden and not choice.detok.stopped:
            used += 1
            choice.detok.drop_held()
        delta = ChoiceDelta(choice.index, token_ids=seq.new_token_ids[:used])
        if p.logprobs:  # (text_offset is only sent with logprobs)
            delta.text_offsets = [
                choice.offset_counter.add(self._shown_bytes(t, p)) for t in delta.token_ids
            ]
            choice.offsets += delta.text_offsets
        if seq.new_logprobs:
            delta.logprobs = seq.new_logprobs[:used]
            delta.top_logprobs = (seq.new_top_logprobs or [[] for _ in delta.logprobs])[:used]
        choice.token_ids += delta.token_ids
        choice.logprobs += delta.logprobs
        choice.top_logprobs += delta.top_logprobs
        if seq.cumulative_logprob is not None:
            choice.cumulative_logprob = seq.cumulative_logprob
        if choice.detok.stopped and not self.group.engine_stops(state.request_id):
            choice.finish_reason = "stop"  # cut by a stop string: its value (if any) is dropped
        elif seq.finish_reason:  # with engine_stop_strings, also a cut choice's final output
            choice.custom_output = seq.custom_output
            if seq.finish_reason == "content_filter":  # the flagged token has no text
                choice.detok.drop_held()
            else:
                choice.detok.finish()
            choice.finish_reason = "stop" if choice.detok.stopped else seq.finish_reason
        if choice.finish_reason == "stop":
            choice.stop_reason = self._stop_reason(choice, p)
        delta.finish_reason, delta.stop_reason = choice.finish_reason, choice.stop_reason
        delta.rows = self._take_rows(state, choice, seq)
        if choice.finish_reason:  # the final text may hold less (held bytes dropped, a cut)
            delta.text_offsets = [min(o, len(choice.text)) for o in delta.text_offsets]
        delta.text = choice.detok.take_delta(final=choice.finish_reason is not None)
        return delta

    def _take_rows(
        self, state: PromptState, choice: Choice, seq: wire.SequenceOutput
    ) -> Rows | None:
        """The delta's rows: the prompt's not handed out yet, then those of tokens the choice
        kept (a token cut with a stop string loses its row) and a flagged token's."""
        new = state.add_rows(seq.custom_rows, seq.custom_positions)
        if not state.multi_row:
            return None
        if new is None:
            return choice.take_prompt_rows()
        start, end = len(state.prompt_ids), len(state.prompt_ids) + len(choice.token_ids)
        flagged = end if choice.finish_reason == "content_filter" else -1
        kept = new.select(lambda q: start <= q < end or q == flagged)
        choice.rows.extend(kept)
        return join([choice.take_prompt_rows(), kept])

    def _open_prompt_bytes(self, prompt_ids: list[int], p: SamplingParams) -> bytes:
        """The bytes of a character the prompt leaves unfinished (b"" without logprobs)."""
        if not p.logprobs:
            return b""
        return open_character_bytes([self._shown_bytes(t, p) for t in prompt_ids[-3:]])

    def _shown_bytes(self, token: int, p: SamplingParams) -> bytes:
        """The bytes a token adds to its choice's text."""
        if p.skip_special_tokens and token in self.tokenizer.special_ids:
            return b""
        return self.tokenizer.text_bytes(token)

    def _stop_reason(self, choice: Choice, p: SamplingParams) -> int | str | None:
        """What ended a "stop" choice, as vLLM says it: the stop string, a stop token id or an
        EOS other than the tokenizer's own; else None."""
        if choice.detok.stopped:
            return choice.detok.stop.matched
        last = choice.token_ids[-1] if choice.token_ids else None
        if last is None or (not p.ignore_eos and last == self.primary_eos):
            return None
        return last if p.ends_on(last, self.eos_token_ids) else None

    def _finish_rest(self, state: PromptState) -> list[ChoiceDelta]:
        deltas = []
        for choice in state.choices.values():
            if choice.finish_reason is None:
                choice.detok.finish()
                choice.finish_reason = "length"
                deltas.append(
                    ChoiceDelta(
                        choice.index,
                        text=choice.detok.take_delta(True),
                        finish_reason="length",
                        rows=choice.take_prompt_rows(),
                    )
                )
        return deltas

    def _observe(self, deltas: list[ChoiceDelta]) -> None:
        """Time to first token and inter-token latency per choice, as vLLM counts them."""
        if self.metrics is None:
            return
        now = time.monotonic()
        for d in deltas:
            n = len(d.token_ids)
            if not n:
                continue
            last = self._last_token_time.get(d.index)
            if last is None:
                self.metrics.ttft.observe(now - self.start_time)
            else:
                for _ in range(n):
                    self.metrics.itl.observe((now - last) / n)
            self._last_token_time[d.index] = now
            self.metrics.generation_tokens.inc(n)

    # ---- reading ---------------------------------------------------------------------
    async def run(self):
        """Yield lists of choice deltas until the group is done, one per choice a batch."""
        async for batch in self.group.batches():
            deltas = [d for out in batch if out.request_id in self.prompts for d in self.apply(out)]
            yield merge_deltas(deltas) if len(batch) > 1 else deltas

    def prompt_of(self, index: int) -> PromptState:
        """The prompt whose choices include client choice `index`."""
        for prompt in self.prompts.values():
            if prompt.first_index <= index < prompt.first_index + prompt.num_choices:
                return prompt
        raise KeyError(index)

    def value_fields(self, index: int, encoding: str) -> dict:
        """Client choice `index`'s whole value as sent: `custom_output` (and, multi-row,
        `custom_output_positions`); {} when absent."""
        prompt = self.prompt_of(index)
        choice = prompt.choices.get(index - prompt.first_index)
        return (choice or prompt).value_fields(encoding)

    def delta_fields(self, index: int, rows: Rows | None, encoding: str) -> dict:
        """What a streamed chunk of client choice `index` carries: a multi-row selection's new
        `rows` (its deltas') with their positions, else the one-row value once it exists; {}
        when neither."""
        if self.prompt_of(index).multi_row:
            return client_fields(rows, encoding)
        return self.value_fields(index, encoding)

    def choice_omitted(self, index: int) -> str | None:
        """Why client choice `index` has no custom output ("prefix_reuse"), or None."""
        prompt = self.prompt_of(index)
        choice = prompt.choices.get(index - prompt.first_index)
        return choice.custom_output_omitted if choice else prompt.custom_output_omitted

    def choices(self) -> list[Choice]:
        all_choices = [c for s in self.prompts.values() for c in s.choices.values()]
        return sorted(all_choices, key=lambda c: c.index)

    @property
    def done(self) -> bool:
        return all(s.engine_finished or s.all_done() for s in self.prompts.values())

    def usage(self) -> dict:
        prompt = sum(len(s.prompt_ids) for s in self.prompts.values())
        completion = sum(c.num_completion_tokens for c in self.choices())
        cached = sum(s.num_cached_tokens for s in self.prompts.values())
        return _usage(prompt, completion, cached)

    def choice_usage(self, index: int) -> dict:
        """Client choice `index`'s own usage so far (vLLM's continuous_usage_stats)."""
        prompt = self.prompt_of(index)
        choice = prompt.choices.get(index - prompt.first_index)
        completion = choice.num_completion_tokens if choice else 0
        return _usage(len(prompt.prompt_ids), completion, prompt.num_cached_tokens)


def _usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
