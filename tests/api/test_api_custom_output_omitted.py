"""`custom_output_omitted: "prefix_reuse"` on a live server (DESIGN.md, the one-row contract's
last paragraph): a selected prompt position that the prefix cache covered has no value under
the default `--custom-output-reuse omit`, and every surface says why. OpenAI completions and
chat through the official `openai` client (`model_extra`), streaming, native `/generate`."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tests.helpers.api import sse_events, sse_json  # noqa: E402

pytest_plugins = ["tests.helpers.api"]

OMITTED = {"custom_output_omitted": "prefix_reuse"}
_PROMPT_IDS = itertools.count()


def fresh_prompt(tag: str) -> str:
    """A prompt no earlier request of the shared server has cached (81 tokens on the demo
    tokenizer: 80 of them come from the cache on a repeat)."""
    return f"{tag} {next(_PROMPT_IDS)} " + "prefix cache probe " * 10


def extra(obj) -> dict | None:
    return (obj.model_extra or {}).get("extra_outputs")


def test_completions_say_why_the_value_is_absent(client):
    prompt = fresh_prompt("completions")
    kwargs = dict(
        model="tapserve-demo",
        prompt=prompt,
        max_tokens=1,
        extra_body={"custom_output_params": {"position": 0}},
    )
    first = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert set(extra(first)) == {"custom_output"}  # computed: no reason given
    assert set(extra(first.choices[0])) == {"custom_output"}
    again = client.completions.create(**kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert extra(again) == OMITTED  # top level: the last choice's
    assert extra(again.choices[0]) == OMITTED
    # the last prompt token is always computed: a value, and no reason
    last = client.completions.create(**{**kwargs, "extra_body": {}})
    assert last.usage.prompt_tokens_details.cached_tokens > 0
    assert set(extra(last)) == set(extra(last.choices[0])) == {"custom_output"}


def test_completions_with_n_carry_it_on_every_choice(client):
    prompt = fresh_prompt("n")
    client.completions.create(model="tapserve-demo", prompt=prompt, max_tokens=1)
    r = client.completions.create(
        model="tapserve-demo",
        prompt=prompt,
        max_tokens=2,
        n=3,
        temperature=1.0,
        extra_body={"custom_output_params": {"position": 1}},
    )
    assert [extra(c) for c in r.choices] == [OMITTED] * 3
    assert extra(r) == OMITTED


def test_chat_completions_say_why_the_value_is_absent(client):
    messages = [{"role": "user", "content": fresh_prompt("chat")}]
    kwargs = dict(
        model="tapserve-demo",
        messages=messages,
        max_tokens=1,
        extra_body={"custom_output_params": {"position": 0}},
    )
    first = client.chat.completions.create(**kwargs)
    assert set(extra(first)) == {"custom_output"}
    again = client.chat.completions.create(**kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert extra(again) == extra(again.choices[0]) == OMITTED


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streams_say_it_on_each_choices_first_chunk(client, chat):
    text = fresh_prompt("stream-chat" if chat else "stream")
    params = {"custom_output_params": {"position": 0}}
    if chat:
        create = client.chat.completions.create
        kwargs = dict(messages=[{"role": "user", "content": text}])
    else:
        create, kwargs = client.completions.create, dict(prompt=text)
    create(model="tapserve-demo", max_tokens=1, extra_body=params, **kwargs)  # fills the cache
    chunks = list(
        create(
            model="tapserve-demo",
            max_tokens=4,
            n=2,
            temperature=1.0,
            stream=True,
            extra_body={**params, "ignore_eos": True},
            **kwargs,
        )
    )
    seen: set[int] = set()
    for chunk in chunks:
        for choice in chunk.choices:  # (one choice a chunk)
            first = choice.index not in seen
            seen.add(choice.index)
            assert extra(choice) == (OMITTED if first else None), (choice.index, chunk)
            assert extra(chunk) == extra(choice)  # the chunk's own choice's
    assert seen == {0, 1}


def test_native_generate_says_it_beside_custom_output(http):
    prompt = fresh_prompt("native")
    body = {
        "prompt": prompt,
        "generate_config": {"max_new_tokens": 2},
        "custom_output_params": {"position": 0},
    }
    first = http.post("/generate", json=body).json()
    assert "custom_output" in first and "custom_output_omitted" not in first
    again = http.post(
        "/generate",
        json={**body, "generate_config": {"max_new_tokens": 2, "return_aux_info": True}},
    ).json()
    assert again["aux_info"]["reuse_len"] > 0
    assert "custom_output" not in again and again["custom_output_omitted"] == "prefix_reuse"
    listed = http.post(
        "/generate",
        json={**body, "generate_config": {"max_new_tokens": 2, "num_return_sequences": 2}},
    ).json()
    assert "custom_output" not in listed and listed["custom_output_omitted"] == "prefix_reuse"


def test_native_stream_says_it_on_its_first_event_and_in_the_answer(server):
    prompt = fresh_prompt("native-stream")
    body = {
        "prompt": prompt,
        "generate_config": {"max_new_tokens": 4, "ignore_eos": True},
        "custom_output_params": {"position": 0},
    }
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        http.post("/generate", json=body)
        with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
            events = sse_json(sse_events(r))
    # the first event says it (the final one, the whole answer, too); the ones between do not
    assert events[0]["custom_output_omitted"] == "prefix_reuse"
    assert all("custom_output_omitted" not in e for e in events[1:-1]), events
    final = events[-1]
    assert final["finished"] and final["custom_output_omitted"] == "prefix_reuse"
    assert all("custom_output" not in e for e in events), json.dumps(events)
