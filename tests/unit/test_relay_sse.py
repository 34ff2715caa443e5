"""Streamed chunks as the relay writes them: a plain text chunk comes from a per-choice template
(api/openai.py `_Shape.text_event`); every event must be the bytes json.dumps writes for the
OpenAI chunk object, built here independently, for any text."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest

from tapserve.api.choices import ChoiceDelta
from tapserve.api.openai import _events, _Shape
from tapserve.api.openai_schemas import ChatCompletionRequest, CompletionRequest
from tapserve.api.state import sse

TEXTS = [
    "plain",
    "",  # a token whose text is held back (a chunk with no text, as before)
    ' "quoted" \\ back\\slash',
    "line\nbreak\ttab\r\x00\x1f\x7f",
    "ünïcödé 漢字 🙂 \u2028\u2029",
    "\ue000text\ue000",  # the template's own mark, as text
    "\ud800 lone surrogate",
]
USAGE = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}


class FakeGeneration:
    """What `_events` reads of a Generation: one batch per delta list."""

    def __init__(self, batches: list[list[ChoiceDelta]]):
        self.batches = batches
        self.group = SimpleNamespace(request_ids=["cmpl-x1"])

    async def run(self):
        for batch in self.batches:
            yield batch

    def delta_fields(self, index, rows, encoding) -> dict:
        return {}

    def choice_omitted(self, index) -> None:
        return None

    def usage(self) -> dict:
        return USAGE

    def choice_usage(self, index) -> dict:
        return USAGE


def expected_event(chat: bool, index: int, first: bool, delta: ChoiceDelta, usage: str) -> str:
    """The chunk as OpenAI (and this server before the templates) writes it."""
    choice: dict = {"index": index}
    if chat:
        choice["delta"] = (
            {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        )
    else:
        choice["text"] = delta.text
    choice.update(logprobs=None, finish_reason=delta.finish_reason, stop_reason=None)
    body = {
        "id": "cmpl-x1",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 7,
        "model": "m",
        "choices": [choice],
    }
    if usage == "null":
        body["usage"] = None
    elif usage == "continuous":
        body["usage"] = USAGE
    return "data: " + json.dumps(body, ensure_ascii=False, allow_nan=False) + "\n\n"


def collect(generation, body, chat: bool) -> list[str]:
    async def run() -> list[str]:
        shape = _Shape(None, chat, body)
        kind = "chat.completion" if chat else "text_completion"
        return [e async for e in _events(generation, body, shape, kind, "m", 7)]

    return asyncio.run(run())


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("usage", ["absent", "null", "continuous"])
def test_streamed_events_are_the_chunks_json_dumps_writes(chat: bool, usage: str):
    common = {"model": "m", "stream": True}
    if usage != "absent":
        common["stream_options"] = {
            "include_usage": True,
            "continuous_usage_stats": usage == "continuous",
        }
    if chat:
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **common)
    else:
        body = CompletionRequest(prompt=[1, 2, 3], **common)
    batches, want = [], []
    for step, text in enumerate(TEXTS * 2):
        deltas = [
            ChoiceDelta(i, text=f"{text}{i}" if i else text, token_ids=[step]) for i in (0, 1)
        ]
        if step == len(TEXTS) * 2 - 1:
            deltas[1].finish_reason = "length"
        batches.append(deltas)
        events = [expected_event(chat, d.index, step == 0, d, usage) for d in deltas]
        want.append("".join(events))
    if usage != "absent":
        tail = {"id": "cmpl-x1", "object": "chat.completion.chunk" if chat else "text_completion"}
        tail.update(created=7, model="m", choices=[], usage=USAGE)
        want.append("data: " + json.dumps(tail, ensure_ascii=False) + "\n\n")
    want.append("data: [DONE]\n\n")
    assert collect(FakeGeneration(batches), body, chat) == want


def test_a_delta_with_neither_text_nor_tokens_sends_nothing():
    body = CompletionRequest(prompt=[1], model="m", stream=True)
    batches = [[ChoiceDelta(0, text="a", token_ids=[1])], [ChoiceDelta(0)]]
    events = collect(FakeGeneration(batches), body, chat=False)
    assert len(events) == 2 and events[-1] == "data: [DONE]\n\n"


def test_sse_refuses_nan_as_json_dumps_does():
    assert sse({"a": "ü", "b": [1.5]}) == 'data: {"a": "ü", "b": [1.5]}\n\n'
    with pytest.raises(ValueError):
        sse({"x": math.nan})
