"""Offline use in one process: `LLM(EngineConfig(...)).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import numpy as np
import torch

from tapserve.api.detokenizer import IncrementalDetokenizer, StopChecker
from tapserve.api.sampling_params import SamplingParams, is_integer
from tapserve.api.tokenizer import TextTokenizer
from tapserve.api.wire import Outputs, RequestOutput
from tapserve.coordinator.config import EngineConfig
from tapserve.coordinator.custom_outputs import RequestError, decode_value
from tapserve.coordinator.generation_defaults import model_sampling_defaults
from tapserve.coordinator.startup import build_engine, build_runner


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[list]] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    text: str | None = None
    custom_output: torch.Tensor | None = None  # LAST_GENERATED: this sequence's own value
    # a multi-row selection: its prompt rows and its own, and each row's position in
    # prompt + generated ids (None without rows)
    custom_output_positions: list[int] | None = None
    _rows: list[tuple[dict, list[int]]] = field(default_factory=list, repr=False)  # _joined's


@dataclass
class GenerationResult:
    """One prompt's result. custom_output: the one-row value; for a multi-row selection its
    prompt rows (each sequence's CompletionOutput has its whole value), with
    custom_output_positions."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    custom_output: torch.Tensor | None = None
    num_cached_tokens: int = 0
    error_code: int | None = None
    error_message: str | None = None
    custom_output_positions: list[int] | None = None
    _prompt_rows: list[tuple[dict, list[int]]] = field(default_factory=list, repr=False)

    def join_rows(self) -> None:
        """Multi-row selections: each sequence's value, its prompt rows then its own."""
        if not self._prompt_rows and not any(c._rows for c in self.outputs):
            return
        for c in self.outputs:
            c.custom_output, c.custom_output_positions = _joined(self._prompt_rows + c._rows)
        self.custom_output, self.custom_output_positions = _joined(self._prompt_rows)

    def accumulate(self, out: RequestOutput) -> None:
        for s in out.sequences:
            while len(self.outputs) <= s.index:
                self.outputs.append(CompletionOutput(len(self.outputs)))
            c = self.outputs[s.index]
            c.token_ids += s.new_token_ids
            c.logprobs += s.new_logprobs or []
            c.top_logprobs += s.new_top_logprobs or []
            c.finish_reason = s.finish_reason or c.finish_reason
            if s.cumulative_logprob is not None:
                c.cumulative_logprob = s.cumulative_logprob
            if s.custom_output is not None:
                c.custom_output = decode_value(s.custom_output)
            if s.custom_rows is not None:  # (decoded once, joined: join_rows)
                c._rows.append((s.custom_rows, s.custom_positions))
        if out.custom_rows is not None:
            self._prompt_rows.append((out.custom_rows, out.custom_positions))
        if out.custom_output is not None:
            if self.custom_output is None:  # it rides on every later output: decode it once
                self.custom_output = decode_value(out.custom_output)
        elif out.finished and self.outputs:  # LAST_GENERATED: the last sequence's value
            self.custom_output = self.outputs[-1].custom_output
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        self.error_code, self.error_message = out.error_code, out.error_message


class LLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config or EngineConfig(**kwargs)
        self.runner = build_runner(self.config)
        self.engine = build_engine(self.config, self.runner)
        self.tokenizer = _load_tokenizer(self.config)
        self.model_defaults = model_sampling_defaults(self.config.model_dir())
        self._ids = count()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        custom_output_params: list[dict | None] | None = None,
        raise_errors: bool = True,
    ) -> list[GenerationResult]:
        """Run prompts (text or token ids; one string is one prompt) to completion, sharing
        batches; results in order. params None: the model's generation_config.json
        defaults, as the server and vLLM take them. raise_errors: a request that fails
        (605 at admission, or 606 from the head later) raises RequestError once every
        request of the call has ended; False leaves the code on its result."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = params or SamplingParams(**self.model_defaults)
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        cop = custom_output_params or [None] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in params_list):
            raise TypeError("params must be a SamplingParams or a list of them")
        if not len(params_list) == len(cop) == len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts, but {len(params_list)} sampling params "
                f"and {len(cop)} custom_output_params: give one per prompt"
            )
        results: dict[str, GenerationResult] = {}
        token_ids = [self._encode(prompt) for prompt in prompts]  # before anything is queued
        for ids, p, c in zip(token_ids, params_list, cop):
            rid = f"offline-{next(self._ids)}"
            results[rid] = GenerationResult(rid, ids)
            try:
                self.engine.add_request(rid, ids, p, c)
            except RequestError as e:
                if raise_errors:
                    self._abort(list(results)[:-1])  # this call's requests must not linger
                    raise
                results[rid].error_code, results[rid].error_message = e.code, e.message
        try:
            self._run(results)
        except BaseException:
            try:  # a step that raised leaves none of them behind for the next call
                self._abort(list(results))
            except Exception:
                pass  # (the step's own error is the one to report)
            raise
        failed = [r for r in results.values() if r.error_code is not None]
        if raise_errors and failed:
            raise RequestError(
                failed[0].error_code, f"{failed[0].request_id}: {failed[0].error_message}"
            )
        for r, p in zip(results.values(), params_list):
            self._finish(r, p)
        return list(results.values())

    def _finish(self, result: GenerationResult, p: SamplingParams) -> None:
        """Each output's text, written as the API process writes it (its detokenizer, but
        no stop strings), and no cumulative log-probability where none was computed (as
        vLLM: None)."""
        result.join_rows()
        for o in result.outputs:
            if not p.logprobs and p.num_beams == 1:
                o.cumulative_logprob = None
            if self.tokenizer is not None:
                o.text = self._text(result.prompt_token_ids, o.token_ids, p)

    def _text(self, prompt_ids: list[int], ids: list[int], p: SamplingParams) -> str:
        """A last token that ends its sequence (a stop token id, or an EOS the request
        heeds) leaves its text out unless include_stop_str_in_output, and with it a
        character it might have completed; special tokens as skip_special_tokens says."""
        hidden = p.hides_last(ids, self.engine.options.eos_token_ids)
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, p.skip_special_tokens, StopChecker()
        )
        detok.add_tokens(ids[: len(ids) - hidden])
        if hidden:
            detok.drop_held()
        detok.finish()
        return detok.take_delta(final=True)

    def _run(self, results: dict[str, GenerationResult]) -> None:
        row_steps: list[Outputs] = []  # steps with row columns (their rows joined at the end)
        while self.engine.has_work():
            step = self.engine.step()
            for out in step.outputs:
                results[out.request_id].accumulate(out)
            for rid, token in zip(step.token_request_ids, step.new_token_ids):
                results[rid].outputs[0].token_ids.append(token)  # sequence 0's next token
            if step.row_request_ids:
                for rid, token in zip(step.row_request_ids, step.row_token_ids):
                    outputs = results[rid].outputs
                    (outputs[0] if outputs else _first(outputs)).token_ids.append(token)
                row_steps.append(step)
        for rid, part in _column_parts(row_steps).items():
            results[rid].outputs[0]._rows.append(part)

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt  # numpy, torch
            if not isinstance(ids, (list, tuple)) or not all(map(is_integer, ids)):
                raise ValueError(
                    f"a prompt is a string or a list of token ids (integers), "
                    f"got {str(prompt)[:80]}"
                )
            return [int(t) for t in ids]
        if self.tokenizer is None:
            where = (
                f"--tokenizer {self.config.tokenizer} has no tokenizer.json"
                if self.config.tokenizer
                else "the model folder has no tokenizer.json"
            )
            raise ValueError(
                f"a text prompt needs a tokenizer, and {where}: pass token ids, "
                "or a tokenizer folder (EngineConfig(tokenizer=...), --tokenizer)"
            )
        return self.tokenizer.encode(prompt)  # special tokens added, as transformers' encode

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort_request(rid)
        while self.engine.has_work():
            self.engine.step()


def _first(outputs: list[CompletionOutput]) -> CompletionOutput:
    """Sequence 0's output, made on its first news."""
    outputs.append(CompletionOutput(0))
    return outputs[0]


def _column_parts(steps: list[Outputs]) -> dict[str, tuple[dict, list[int]]]:
    """The rows of the steps' row columns, each request's as one wire value and its
    positions (sequence 0's rows, in step order)."""
    if not steps:
        return {}
    request_ids = [rid for step in steps for rid in step.row_request_ids]
    positions = np.array([p for step in steps for p in step.row_positions], np.int64)
    first = steps[0].rows
    data = np.frombuffer(b"".join(step.rows["data"] for step in steps), np.uint8)
    data = data.reshape(len(request_ids), -1)
    numbers = {rid: i for i, rid in enumerate(dict.fromkeys(request_ids))}
    owners = np.array([numbers[rid] for rid in request_ids], np.int64)
    groups = np.split(np.argsort(owners, kind="stable"), np.cumsum(np.bincount(owners))[:-1])
    parts = {}
    for rid, rows in zip(numbers, groups):
        shape = [len(rows), *first["shape"][1:]]
        value = {"dtype": first["dtype"], "shape": shape, "data": data[rows].tobytes()}
        parts[rid] = (value, positions[rows].tolist())
    return parts


def _joined(parts: list[tuple[dict, list[int]]]) -> tuple[torch.Tensor | None, list[int] | None]:
    """Row deltas (wire value, positions) in position order, concatenated (None, None for
    none)."""
    if not parts:
        return None, None
    first = parts[0][0]
    positions = np.array([p for _, ps in parts for p in ps], np.int64)
    data = b"".join(value["data"] for value, _ in parts)
    if (np.diff(positions) < 0).any():  # a part's rows before another's
        order = np.argsort(positions, kind="stable")
        rows = np.frombuffer(data, np.uint8).reshape(len(positions), -1)
        data, positions = rows[order].tobytes(), positions[order]
    value = {"dtype": first["dtype"], "shape": [len(positions), *first["shape"][1:]], "data": data}
    return decode_value(value), positions.tolist()


def _load_tokenizer(config: EngineConfig) -> TextTokenizer | None:
    """The folder's tokenizer.json, as the API process loads it; None without one (a
    checkpoint without tokenizer files: token-id prompts only, and no text)."""
    path = Path(config.tokenizer or config.model_dir())
    if not (path / "tokenizer.json").is_file():
        return None
    return TextTokenizer.from_dir(path)
