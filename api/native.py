"""Native routes: /generate, /custom_output, /tokenize, /detokenize.

`POST /generate` is rtp-llm style: one list entry per sequence with `num_return_sequences` or
beams; a stream ends with a `finished: true` event. `POST /custom_output` scores every prompt
or conversation at once (max_new_tokens = 0); `outputs` holds each prompt's value or error, in
order. docs/api.md has the fields.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from tapserve.api import token_list
from tapserve.api.choices import Choice, ChoiceDelta
from tapserve.api.custom_rows import join
from tapserve.api.errors import ApiError, invalid
from tapserve.api.generation import Generation
from tapserve.api.openai_schemas import ChatMessage, ChatTemplateFields, StrictModel
from tapserve.api.sampling_params import SamplingParams
from tapserve.api.state import OFF_LOOP_BODY_BYTES, AppState, race_disconnect, sse
from tapserve.api.values import finite_logprob


class GenerateConfig(StrictModel):
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    # None: the model's default (generation_config.json), else SamplingParams'
    temperature: float | None = None
    do_sample: bool | None = None  # False: greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_return_sequences: int | None = Field(None, ge=1)
    num_beams: int = Field(1, ge=1)
    length_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_words_str: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_aux_info: bool = False
    return_output_ids: bool = False

    def check_sequences(self, state: AppState) -> None:
        """605s naming the field: too many sequences or beams, more sequences than beams, or
        do_sample with beams."""
        state.check_n(self.num_beams, "num_beams")
        state.check_n(self.num_return_sequences or 1, "num_return_sequences")
        if self.num_beams > 1 and (self.num_return_sequences or 1) > self.num_beams:
            raise invalid("num_return_sequences must be <= num_beams", "num_return_sequences")
        if self.num_beams > 1 and self.do_sample:
            raise invalid(
                "do_sample with num_beams > 1 (beam sampling) is not supported", "do_sample"
            )

    @property
    def listed(self) -> bool:
        """Answer with one list entry per sequence."""
        return self.num_return_sequences is not None or self.num_beams > 1

    def sampling_kwargs(self, max_new_tokens: int) -> dict:
        """SamplingParams' fields; a 605 naming min_new_tokens when it exceeds max_new_tokens."""
        if self.min_new_tokens > max_new_tokens:
            raise invalid(
                f"min_new_tokens must be <= max_new_tokens, got {self.min_new_tokens} "
                f"> {max_new_tokens}",
                "min_new_tokens",
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        beams = self.num_beams > 1
        optional = {
            "temperature": 0.0 if self.do_sample is False else self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }
        return {
            **{name: value for name, value in optional.items() if value is not None},
            "max_new_tokens": max_new_tokens,
            "min_tokens": self.min_new_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "n": self.num_beams if beams else (self.num_return_sequences or 1),
            "num_beams": self.num_beams,
            "length_penalty": self.length_penalty,
            "stop": stop + list(self.stop_words_str or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }


class GenerateRequest(StrictModel):
    prompt: str | None = None
    input_ids: list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    generate_config: GenerateConfig = Field(default_factory=GenerateConfig)
    custom_output_params: dict[str, Any] | None = None
    custom_output_encoding: Literal["json", "base64"] = "json"
    stream: bool = False


class CustomOutputRequest(ChatTemplateFields):
    prompts: list[str | list[int]] | None = Field(None, min_length=1)
    conversations: list[Annotated[list[ChatMessage], Field(min_length=1)]] | None = Field(
        None, min_length=1
    )
    custom_output_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    custom_output_encoding: Literal["json", "base64"] = "json"


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None  # as vLLM: if given, the served model's name (else a 404)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages


def _state(request: Request) -> AppState:
    return request.app.state.tapserve


def _one_source(body: Any) -> None:
    given = [n for n in ("prompt", "input_ids", "messages") if getattr(body, n, None) is not None]
    if len(given) != 1:
        raise invalid("give exactly one of prompt, input_ids, messages", "prompt")


def _generate_ids(state: AppState, body: GenerateRequest) -> list[int]:
    _one_source(body)
    if body.messages is not None:
        return state.prompt_ids(
            ChatTemplateFields().render(state.tokenizer, body.messages),
            "messages",
            add_special_tokens=False,
        )
    return state.prompt_ids(
        body.prompt if body.prompt is not None else body.input_ids,
        "prompt" if body.prompt is not None else "input_ids",
    )


# ---- /generate answers -------------------------------------------------------------------
class _Answer:
    """Builds /generate bodies from a finished (or running) generation."""

    def __init__(self, body: GenerateRequest, generation: Generation, start: float):
        self.cfg, self.body, self.gen, self.start = body.generate_config, body, generation, start
        self.count = self.cfg.num_return_sequences or (
            self.cfg.num_beams if self.cfg.num_beams > 1 else 1
        )
        self.events_sent = 0

    def _pick(self, values: list) -> Any:
        return values[: self.count] if self.cfg.listed else (values[0] if values else None)

    def final(self, deltas: list | None = None) -> dict:
        """The whole answer; for a stream's last event (`deltas` given), `response` holds only
        the text not sent yet."""
        choices = self.gen.choices()
        if deltas is None:
            texts = [c.text for c in choices]
        else:
            by_index = {d.index: d.text for d in deltas}
            texts = [by_index.get(c.index, "") for c in choices]
        out: dict[str, Any] = {
            "response": self._pick(texts),
            "finished": True,
            "finish_reason": self._pick([c.finish_reason for c in choices]),
        }
        out.update(self._value(len(choices[: self.count]), deltas))
        out.update(self._omitted())
        if self.cfg.return_output_ids:
            out["output_ids"] = self._pick([c.token_ids for c in choices])
        if self.cfg.return_aux_info:
            out["aux_info"] = self._pick([self._aux(c, choices) for c in choices])
        return out

    def _value(self, count: int, deltas: list[ChoiceDelta] | None = None) -> dict:
        """Each sequence's value, and a multi-row selection's positions (null in a list where
        none yet); absent when none has one. deltas: a streamed event's, whose new rows it
        carries (a one-row value: the whole value)."""
        encoding = self.body.custom_output_encoding
        if deltas is None:
            fields = [self.gen.value_fields(i, encoding) for i in range(max(count, 1))]
        else:
            fields = [
                self.gen.delta_fields(i, join(d.rows for d in deltas if d.index == i), encoding)
                for i in range(max(count, 1))
            ]
        values = [f.get("custom_output") for f in fields]
        if all(v is None for v in values) or (not self.cfg.listed and values[0] is None):
            return {}
        out = {"custom_output": values[:count] if self.cfg.listed else values[0]}
        positions = [f.get("custom_output_positions") for f in fields]
        if any(p is not None for p in positions):
            out["custom_output_positions"] = positions[:count] if self.cfg.listed else positions[0]
        return out

    def _omitted(self) -> dict:
        """custom_output_omitted ("prefix_reuse") beside custom_output, or {}."""
        reason = self.gen.choice_omitted(0)
        return {} if reason is None else {"custom_output_omitted": reason}

    def _aux(self, c: Choice, choices: list[Choice]) -> dict:
        aux = {
            "input_len": len(c.prompt.prompt_ids),
            "output_len": c.num_completion_tokens,
            "reuse_len": c.prompt.num_cached_tokens,
            "cost_time_ms": round((time.monotonic() - self.start) * 1000, 3),
        }
        if self.cfg.num_beams > 1:
            aux["cum_log_probs"] = finite_logprob(c.cumulative_logprob)  # (-inf: -9999.0)
            aux["beam_responses"] = [x.text for x in choices]
        return aux

    def delta_event(self, deltas: list) -> dict | None:
        texts = {d.index: d.text for d in deltas}
        if not any(texts.values()) and not any(d.token_ids or d.rows for d in deltas):
            return None
        response = (
            [texts.get(i, "") for i in range(self.count)] if self.cfg.listed else texts.get(0, "")
        )
        first = self._omitted() if not self.events_sent else {}
        self.events_sent += 1
        value = self._value(self.count, deltas)
        return {"response": response, "finished": False, **value, **first}


async def _generate_events(answer: _Answer) -> AsyncIterator[str]:
    pending: list = []
    async for deltas in answer.gen.run():
        if answer.gen.done:
            pending += deltas
            continue
        event = answer.delta_event(deltas)
        if event is not None:
            yield sse(event)
    yield sse(answer.final(pending))


# ---- /custom_output ----------------------------------------------------------------------
def _score_params(body: CustomOutputRequest) -> list[dict | None]:
    cop = body.custom_output_params
    if isinstance(cop, list):
        if len(cop) != _count(body):
            raise invalid(
                "custom_output_params must have one entry per prompt", "custom_output_params"
            )
        return cop
    return [cop] * _count(body)


def _count(body: CustomOutputRequest) -> int:
    """The request's prompts: its `prompts` or its `conversations`, exactly one given."""
    if (body.prompts is None) == (body.conversations is None):
        raise invalid("give exactly one of prompts, conversations", "prompts")
    return len(body.prompts if body.prompts is not None else body.conversations)


def _score_ids(state: AppState, body: CustomOutputRequest) -> list[list[int] | dict]:
    """Each prompt's (or conversation's) token ids, or its error entry."""
    out: list[list[int] | dict] = []
    for i in range(_count(body)):
        try:
            if body.conversations is not None:
                text = body.render(state.tokenizer, body.conversations[i])
                out.append(state.prompt_ids(text, f"conversations.{i}", add_special_tokens=False))
            else:
                out.append(state.prompt_ids(body.prompts[i], f"prompts.{i}"))
        except ApiError as e:
            out.append(e.native_body())
    return out


def _submit_score(
    state: AppState, request: Request, ids: list[int], cop: dict | None
) -> Generation | dict:
    """One prompt's scoring request sent, or its error entry."""
    params = SamplingParams(max_new_tokens=0)  # scoring samples nothing: no model defaults
    try:
        return state.submit(request, "score", [(ids, params)], [cop])
    except ApiError as e:
        return e.native_body()


async def _score_one(
    state: AppState, request: Request, generation: Generation, encoding: str
) -> dict:
    try:
        await state.accepted(request, generation, watch=False)
        await state.collect(request, generation, watch=False)
    except ApiError as e:
        return e.native_body()
    prompt = next(iter(generation.prompts.values()))
    out = {"input_len": len(prompt.prompt_ids), "reuse_len": prompt.num_cached_tokens}
    return {**out, **generation.value_fields(prompt.first_index, encoding)}


async def _entry(entry: dict) -> dict:
    return entry


def build_router() -> APIRouter:
    router = APIRouter()

    @router.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Any:
        state = _state(request)
        start = time.monotonic()
        ids = await state.prepare(request, lambda: _generate_ids(state, body))
        cfg = body.generate_config
        cfg.check_sequences(state)
        max_new = state.max_new_tokens(cfg.max_new_tokens, len(ids), "max_new_tokens")
        params = state.sampling_params(**cfg.sampling_kwargs(max_new))
        generation = await state.start(request, "gen", [(ids, params)], [body.custom_output_params])
        answer = _Answer(body, generation, start)
        if body.stream:
            return state.stream(request, generation, lambda: _generate_events(answer))
        await state.collect(request, generation)
        return JSONResponse(answer.final())

    @router.post("/custom_output")
    async def custom_output(body: CustomOutputRequest, request: Request) -> Any:
        state = _state(request)
        count, field = _count(body), "prompts" if body.prompts is not None else "conversations"
        if count > state.config.max_prompts:
            raise invalid(f"at most {state.config.max_prompts} prompts per request", field)
        cops = _score_params(body)
        state.admit(count, field)  # before the tokenizing: a quick 503
        prompt_ids = await state.prepare(request, lambda: _score_ids(state, body))
        # no await between admission and submission: no other request takes the room halfway
        state.admit(sum(isinstance(ids, list) for ids in prompt_ids), field)
        submitted: list[Generation | dict] = [
            _submit_score(state, request, ids, cop) if isinstance(ids, list) else ids
            for ids, cop in zip(prompt_ids, cops)
        ]
        jobs = [
            _entry(s)
            if isinstance(s, dict)
            else _score_one(state, request, s, body.custom_output_encoding)
            for s in submitted
        ]
        try:
            outputs = await race_disconnect(request, asyncio.gather(*jobs))
        except BaseException:  # the client left: a job cancelled before it ran aborts nothing
            for generation in submitted:
                if not isinstance(generation, dict):
                    generation.group.abort()
            raise
        return {"outputs": outputs}

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        state = _state(request)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("give exactly one of prompt, messages", "prompt")

        def encode() -> JSONResponse:  # rendered here too: a long answer's JSON takes long
            if body.messages is not None:
                text = body.render(state.tokenizer, body.messages)
                ids = state.encode(
                    text, "messages", add_special_tokens=bool(body.add_special_tokens)
                )
            else:
                ids = state.encode(
                    body.prompt, "prompt", add_special_tokens=body.add_special_tokens is not False
                )
            return JSONResponse(
                {
                    "tokens": ids,
                    "count": len(ids),
                    "max_model_len": state.config.max_model_len,
                    "token_strs": [state.tokenizer.token_str(t) for t in ids],
                }
            )

        return await state.prepare(request, encode)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        # read here, not by FastAPI: a large body is parsed in a worker thread (token_list.py)
        state, raw = _state(request), await request.body()
        content_type = request.headers.get("content-type")
        fast = len(raw) > OFF_LOOP_BODY_BYTES  # (the bodies AppState.prepare takes off the loop)
        return await state.prepare(
            request, lambda: token_list.detokenize(state, raw, content_type, fast)
        )

    return router
