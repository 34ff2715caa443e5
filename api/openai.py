"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Prompt p's sample i is choice `p * n + i`; each choice carries its own
`extra_outputs.custom_output` (with `custom_output_positions` for a multi-row selection), and
the object that of its last choice (DESIGN.md); a streamed multi-row value comes as each
chunk's new rows. Errors known before the first token are plain HTTP answers.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tapserve.api.choices import Choice, ChoiceDelta
from tapserve.api.errors import invalid
from tapserve.api.generation import Generation
from tapserve.api.openai_schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from tapserve.api.state import AppState, json_string, sse
from tapserve.api.values import finite_logprob

# the text of a template event, where each plain chunk's text goes (a private-use character
# keeps it from meeting JSON escapes)
_TEXT_MARK = "\ue000text\ue000"


def _state(request: Request) -> AppState:
    return request.app.state.tapserve


def _extra(value_fields: dict, omitted: str | None = None) -> dict:
    """{"extra_outputs": {"custom_output": ..., ...}} with any `custom_output_omitted`; {} if
    neither. value_fields: Generation.value_fields' or delta_fields' answer."""
    extra = dict(value_fields)
    if omitted is not None:
        extra["custom_output_omitted"] = omitted
    return {"extra_outputs": extra} if extra else {}


# ---- logprobs ----------------------------------------------------------------------------
def _completion_logprobs(
    state: AppState,
    token_ids: list[int],
    logprobs: list[float],
    tops: list[list[list]],
    offsets: list[int],
) -> dict:
    """Legacy completions logprobs; a token that is part of a character is written
    `bytes:\\xNN...`, as OpenAI does, so such tokens stay distinct keys of top_logprobs."""
    name = state.tokenizer.legacy_token_str
    top_dicts = []
    for token, lp, top in zip(token_ids, logprobs, tops):
        entry = {name(t): finite_logprob(v) for t, v in top}
        entry.setdefault(name(token), finite_logprob(lp))
        top_dicts.append(entry)
    return {
        "tokens": [name(t) for t in token_ids],
        "token_logprobs": [finite_logprob(v) for v in logprobs],
        "top_logprobs": top_dicts,
        "text_offset": list(offsets),
    }


def _chat_logprobs(
    state: AppState,
    token_ids: list[int],
    logprobs: list[float],
    tops: list[list[list]],
    num_top: int,
) -> dict:
    def item(t: int, lp: float) -> dict:
        return {
            "token": state.tokenizer.token_str(t),
            "logprob": finite_logprob(lp),
            "bytes": list(state.tokenizer.token_bytes(t)),
        }

    content = [
        {**item(t, lp), "top_logprobs": [item(a, b) for a, b in top[:num_top]]}
        for t, lp, top in zip(token_ids, logprobs, tops)
    ]
    return {"content": content, "refusal": None}


# ---- shared ------------------------------------------------------------------------------
def _params(
    state: AppState,
    body: _SamplingFields,
    max_tokens: int | None,
    prompt_len: int,
    logprobs: bool,
    top_logprobs: int,
    max_tokens_param: str = "max_tokens",
) -> Any:
    state.check_n(body.n, "n")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    max_new = state.max_new_tokens(max_tokens, prompt_len, max_tokens_param)
    return state.sampling_params(
        **body.sampling_kwargs(max_new), logprobs=logprobs, top_logprobs=top_logprobs
    )


def _completion_max_tokens(state: AppState, body: CompletionRequest, prompt_len: int) -> int | None:
    """max_tokens as sent; when absent, OpenAI's default of 16 cut to the context's room (as
    vLLM)."""
    if "max_tokens" in body.model_fields_set:
        return body.max_tokens
    return min(body.max_tokens, state.config.max_model_len - prompt_len)


def _envelope(generation: Generation, kind: str, model: str, created: int) -> dict:
    return {
        "id": generation.group.request_ids[0],
        "object": kind,
        "created": created,
        "model": model,
    }


class _Shape:
    """How completions and chat differ in their choice objects."""

    def __init__(self, state: AppState, chat: bool, body: Any):
        self.state, self.chat, self.body = state, chat, body
        self.want_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        self.num_top = (body.top_logprobs or 0) if chat else (body.logprobs or 0)
        self.started: set[int] = set()
        self._text_events: dict[int, tuple[str, str]] = {}  # choice index -> template halves

    def full_choice(self, c: Choice) -> dict:
        out: dict[str, Any] = {
            "index": c.index,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        lp = (
            self._logprobs(c.token_ids, c.logprobs, c.top_logprobs, c.text_offsets)
            if self.want_logprobs
            else None
        )
        if self.chat:
            out["message"] = {"role": "assistant", "content": c.text}
        else:
            out["text"] = c.text
        out["logprobs"] = lp
        value = c.value_fields(self.body.custom_output_encoding)
        return {**out, **_extra(value, c.custom_output_omitted)}

    def chunk_choice(self, d: ChoiceDelta, value: dict, omitted: str | None) -> dict | None:
        """A choice's chunk, or None for a delta that carries nothing; the first chunk holds
        the role and any `omitted`. value: Generation.delta_fields' answer."""
        if not (d.text or d.finish_reason or d.token_ids or d.rows):
            return None
        first = d.index not in self.started
        self.started.add(d.index)
        out: dict[str, Any] = {"index": d.index}
        if self.chat:
            out["delta"] = (
                {"role": "assistant", "content": d.text} if first else {"content": d.text}
            )
        else:
            out["text"] = d.text
        out["logprobs"] = (
            self._logprobs(d.token_ids, d.logprobs, d.top_logprobs, d.text_offsets)
            if self.want_logprobs
            else None
        )
        out["finish_reason"], out["stop_reason"] = d.finish_reason, d.stop_reason
        return {**out, **_extra(value, omitted if first else None)}

    def is_plain(self, d: ChoiceDelta, value: dict) -> bool:
        """Whether d's chunk is a started choice's text alone (tokens without logprobs, no
        finish, rows or value), so that `text_event` writes it."""
        return (
            d.index in self.started
            and (bool(d.text) or bool(d.token_ids))
            and not (self.want_logprobs or d.finish_reason or d.rows or value)
        )

    def text_event(self, d: ChoiceDelta, head: dict, usage: dict) -> str:
        """The SSE event of a plain delta (`is_plain`): the bytes `sse` writes for its chunk,
        from a template made once per choice. head: _envelope's; usage: {} or {"usage": None}."""
        halves = self._text_events.get(d.index)
        if halves is None:
            template = self.chunk_choice(replace(d, text=_TEXT_MARK), {}, None)
            event = sse({**head, "choices": [template], **usage})
            before, _, after = event.rpartition(json_string(_TEXT_MARK))  # (the last string)
            halves = self._text_events[d.index] = (before, after)
        return halves[0] + json_string(d.text) + halves[1]

    def _logprobs(self, ids: list[int], lps: list[float], tops: list, offsets: list[int]) -> dict:
        if self.chat:
            return _chat_logprobs(self.state, ids, lps, tops, self.num_top)
        return _completion_logprobs(self.state, ids, lps, tops, offsets)


async def _respond(
    request: Request, state: AppState, generation: Generation, body: Any, chat: bool
) -> Any:
    kind = "chat.completion" if chat else "text_completion"
    model, created = state.config.served_model_name, int(time.time())
    shape = _Shape(state, chat, body)
    if body.stream:
        return state.stream(
            request, generation, lambda: _events(generation, body, shape, kind, model, created)
        )
    await state.collect(request, generation)
    all_choices = generation.choices()
    choices = [shape.full_choice(c) for c in all_choices]
    last = all_choices[-1] if all_choices else None
    top = (
        _extra(last.value_fields(body.custom_output_encoding), last.custom_output_omitted)
        if last
        else {}
    )
    return JSONResponse(
        {
            **_envelope(generation, kind, model, created),
            "choices": choices,
            "usage": generation.usage(),
            **top,
        }
    )


async def _events(
    generation: Generation, body: Any, shape: _Shape, kind: str, model: str, created: int
) -> AsyncIterator[str]:
    head = _envelope(generation, kind + ".chunk" if shape.chat else kind, model, created)
    # with include_usage alone, OpenAI's chunks carry "usage": null until the last
    plain_usage = {"usage": None} if body.include_usage else {}
    async for deltas in generation.run():
        events = []
        for d in deltas:
            value = generation.delta_fields(d.index, d.rows, body.custom_output_encoding)
            if not body.continuous_usage and shape.is_plain(d, value):
                events.append(shape.text_event(d, head, plain_usage))
                continue
            choice = shape.chunk_choice(d, value, generation.choice_omitted(d.index))
            if choice is not None:
                # as vLLM: the chunk's own choice, its prompt and the tokens it has streamed
                usage = (
                    {"usage": generation.choice_usage(d.index) if body.continuous_usage else None}
                    if body.include_usage
                    else {}
                )
                top = {k: choice[k] for k in ("extra_outputs",) if k in choice}  # the choice's
                events.append(sse({**head, "choices": [choice], **top, **usage}))
        if events:
            yield "".join(events)  # one write for the choices of one output
    if body.include_usage:
        yield sse({**head, "choices": [], "usage": generation.usage()})
    yield "data: [DONE]\n\n"


# ---- routes ------------------------------------------------------------------------------
def _chat_prompt(state: AppState, body: ChatCompletionRequest) -> list[int]:
    return state.prompt_ids(
        body.render(state.tokenizer, body.messages), "messages", add_special_tokens=False
    )


def _model_card(state: AppState) -> dict:
    return {
        "id": state.config.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "tapserve",
        "max_model_len": state.config.max_model_len,
        # the custom head's column names (or its one value's name), when it declares them
        **(
            {"custom_output_labels": state.config.custom_output_labels}
            if state.config.custom_output_labels is not None
            else {}
        ),
    }


def build_router() -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request) -> dict:
        return {"object": "list", "data": [_model_card(_state(request))]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        state = _state(request)
        state.check_model(model_id)
        return _model_card(state)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        state = _state(request)
        state.check_model(body.model)
        body.check_unsupported()
        prompts = body.prompts()
        if len(prompts) > state.config.max_prompts:
            raise invalid(f"at most {state.config.max_prompts} prompts per request", "prompt")

        def prepare() -> list:
            items = []
            for p in prompts:
                ids = state.prompt_ids(p, "prompt", body.add_special_tokens)
                items.append(
                    (
                        ids,
                        _params(
                            state,
                            body,
                            _completion_max_tokens(state, body, len(ids)),
                            len(ids),
                            body.logprobs is not None,
                            body.logprobs or 0,
                        ),
                    )
                )
            return items

        items = await state.prepare(request, prepare)
        generation = await state.start(
            request, "cmpl", items, [body.custom_output_params] * len(items)
        )
        return await _respond(request, state, generation, body, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        state = _state(request)
        state.check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        ids = await state.prepare(request, lambda: _chat_prompt(state, body))
        request.state.max_tokens_param = body.max_tokens_param  # how engine errors name it
        params = _params(
            state,
            body,
            body.requested_max_tokens,
            len(ids),
            body.logprobs,
            body.top_logprobs or 0,
            body.max_tokens_param,
        )
        generation = await state.start(
            request, "chatcmpl", [(ids, params)], [body.custom_output_params]
        )
        return await _respond(request, state, generation, body, chat=True)

    return router
