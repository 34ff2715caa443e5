"""Offline use in one process: `LLM(EngineConfig(...)).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import torch

from api.wire import RequestOutput
from coordinator.config import EngineConfig, build_engine, build_runner
from coordinator.custom_outputs import RequestError, decode_value
from coordinator.sampling_params import SamplingParams


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


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    custom_output: torch.Tensor | None = None
    num_cached_tokens: int = 0
    error_code: int | None = None
    error_message: str | None = None

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
        self._ids = count()

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams]
                 | None = None, custom_output_params: list[dict | None] | None = None,
                 raise_errors: bool = True) -> list[GenerationResult]:
        """Run prompts (text or token ids) to completion, sharing batches; results in order."""
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        cop = custom_output_params or [None] * len(prompts)
        if not len(params_list) == len(cop) == len(prompts):
            raise ValueError(f"{len(prompts)} prompts, but {len(params_list)} sampling params "
                             f"and {len(cop)} custom_output_params: give one per prompt")
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
        if self.tokenizer is not None:
            for r in results.values():
                for o in r.outputs:
                    o.text = self.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        return list(results.values())

    def _run(self, results: dict[str, GenerationResult]) -> None:
        while self.engine.has_work():
            step = self.engine.step()
            for out in step.outputs:
                results[out.request_id].accumulate(out)
            for rid, token in zip(step.token_request_ids, step.new_token_ids):
                results[rid].outputs[0].token_ids.append(token)  # sequence 0's next token

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            where = (f"--tokenizer {self.config.tokenizer} has none" if self.config.tokenizer
                     else "the model folder has none")
            raise ValueError(f"a text prompt needs a tokenizer, and {where}: pass token ids, "
                             "or a tokenizer folder (EngineConfig(tokenizer=...), --tokenizer)")
        return self.tokenizer.encode(prompt)

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort_request(rid)
        while self.engine.has_work():
            self.engine.step()


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(config: EngineConfig):
    path = Path(config.tokenizer or config.model_dir())
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None  # transformers would build an empty tokenizer from config.json alone
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError):
        return None  # a checkpoint without tokenizer files: token-id prompts only
