"""A generation's per-choice state in the API process: each choice's tokens, text, logprobs
and custom output (one-row value, or a multi-row selection's rows), and the deltas that one
engine output adds to a choice."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from tapserve.api.custom_rows import Rows, client_fields, join
from tapserve.api.detokenizer import IncrementalDetokenizer, TextOffsets
from tapserve.api.sampling_params import SamplingParams
from tapserve.api.values import encode_value


@dataclass
class ChoiceDelta:
    """What one choice gained from one engine output."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list]] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)  # each token's, in the choice's text
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as Choice.stop_reason, once finished
    # multi-row custom outputs: the prompt's rows not yet handed to this choice, then the rows
    # of token_ids (and of a "content_filter" choice's flagged token); None for a one-row value
    rows: Rows | None = None


@dataclass
class Choice:
    index: int
    prompt: PromptState
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list]] = field(default_factory=list)
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice, else None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    offsets: list[int] = field(default_factory=list)  # each token's text_offset, uncut
    offset_counter: TextOffsets = field(default_factory=TextOffsets)
    custom_output: dict | None = None  # the sequence's own value (LAST_GENERATED)
    rows: Rows = field(default_factory=Rows)  # its own rows of a multi-row selection
    prompt_rows_taken: int = 0  # the prompt's rows handed out in this choice's deltas
    _encoded: dict[str, Any] = field(default_factory=dict)

    @property
    def num_completion_tokens(self) -> int:
        """Its tokens in `usage`: those delivered, and a "content_filter" choice's flagged one."""
        return len(self.token_ids) + (self.finish_reason == "content_filter")

    @property
    def text(self) -> str:
        return self.detok.text

    @property
    def custom_output_omitted(self) -> str | None:
        """Why the choice has no value ("prefix_reuse"), or None."""
        return None if self.custom_output is not None else self.prompt.custom_output_omitted

    @property
    def text_offsets(self) -> list[int]:
        """Where each token's text begins in self.text, at most its end."""
        return [min(offset, len(self.text)) for offset in self.offsets]

    def value_fields(self, encoding: str) -> dict:
        """`custom_output` (and, multi-row, `custom_output_positions`) as sent; {} if absent."""
        if not self.prompt.multi_row:
            value = self.encoded_value(encoding)
            return {} if value is None else {"custom_output": value}
        key = (encoding, len(self.prompt.rows), len(self.rows))
        if key not in self._encoded:
            self._encoded.clear()  # rows came since: older encodings are stale
            self._encoded[key] = client_fields(join([self.prompt.rows, self.rows]), encoding)
        return self._encoded[key]

    def take_prompt_rows(self) -> Rows:
        """The prompt's rows this choice has not handed out yet (marked handed out)."""
        rows = self.prompt.rows.since(self.prompt_rows_taken)
        self.prompt_rows_taken = len(self.prompt.rows)
        return rows

    def encoded_value(self, encoding: str) -> Any:
        """The one-row value as sent to clients, its own or else its prompt's (None if absent)."""
        if self.custom_output is None:
            return self.prompt.encoded_value(encoding)
        if encoding not in self._encoded:
            self._encoded[encoding] = encode_value(self.custom_output, encoding)
        return self._encoded[encoding]


@dataclass
class PromptState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_index: int
    choices: dict[int, Choice] = field(default_factory=dict)
    custom_output: dict | None = None
    # why a selected prompt position has no value ("prefix_reuse"); None otherwise
    custom_output_omitted: str | None = None
    num_cached_tokens: int = 0
    engine_finished: bool = False
    rows: Rows = field(default_factory=Rows)  # a multi-row selection's prompt rows
    multi_row: bool = False  # rows of a multi-row selection came (prompt or sequence rows)
    _encoded: dict[str, Any] = field(default_factory=dict)  # encoding -> client value

    def set_custom_output(self, value: dict) -> None:
        if value != self.custom_output:
            self.custom_output, self._encoded = value, {}

    def add_rows(self, value: dict | None, positions: list[int] | None) -> Rows | None:
        """A wire delta of rows (prompt's or a sequence's) as Rows, marking the prompt
        multi-row; None when the output has none."""
        if value is None and positions is None:
            return None
        self.multi_row = True
        return Rows.from_wire(value, positions)

    def value_fields(self, encoding: str) -> dict:
        """The value of a choice not started yet, as Choice.value_fields."""
        if self.multi_row:
            return client_fields(self.rows, encoding)
        value = self.encoded_value(encoding)
        return {} if value is None else {"custom_output": value}

    def encoded_value(self, encoding: str) -> Any:
        """The one-row custom output as sent to clients (None when absent), encoded once."""
        if self.custom_output is None:
            return None
        if encoding not in self._encoded:
            self._encoded[encoding] = encode_value(self.custom_output, encoding)
        return self._encoded[encoding]

    @property
    def num_choices(self) -> int:
        return self.params.n

    def all_done(self) -> bool:
        return len(self.choices) >= self.num_choices and all(
            c.finish_reason for c in self.choices.values()
        )


def merge_deltas(deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
    """One delta per choice index (in index order), concatenating consecutive ones."""
    merged: dict[int, ChoiceDelta] = {}
    for d in deltas:
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = replace(
                d,
                token_ids=list(d.token_ids),
                logprobs=list(d.logprobs),
                top_logprobs=list(d.top_logprobs),
                text_offsets=list(d.text_offsets),
            )
            continue
        m.text += d.text
        m.token_ids += d.token_ids
        m.logprobs += d.logprobs
        m.top_logprobs += d.top_logprobs
        m.text_offsets += d.text_offsets
        m.rows = join([m.rows, d.rows]) if d.rows else m.rows
        m.finish_reason = d.finish_reason or m.finish_reason
        m.stop_reason = d.stop_reason if d.finish_reason else m.stop_reason
    return [merged[i] for i in sorted(merged)]
