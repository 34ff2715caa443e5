"""How a choice ends, pinned on a live server (`python launch.py`, CPU, demo model; fixtures in
tests/helpers/api.py) and read as vLLM's users read it: a stop token id's or an EOS's own text
stays out of the output unless include_stop_str_in_output; stop_reason names the stop string
or stop token id (null for the tokenizer's own EOS and the length limit); stop strings wait for
min_tokens; beam search ends a hypothesis at a stop token id."""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tests.api.test_api_conformance import PROMPT, USER, _eos_ids, _text, model  # noqa: E402,F401
from tests.helpers.api import sse_events, sse_json  # noqa: E402

pytest_plugins = ["tests.helpers.api"]


def test_stop_token_id_text_left_out_unless_asked(http, model):
    ids = http.post(
        "/generate",
        json={
            "prompt": PROMPT,
            "generate_config": {
                "max_new_tokens": 8,
                "do_sample": False,
                "ignore_eos": True,
                "return_output_ids": True,
            },
        },
    ).json()["output_ids"]
    stop_at = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    # the last generated token scored (position -2) finishes the sequence one output later
    for include, scored in ((False, False), (True, False), (False, True)):
        extra = {"custom_output_params": {"position": -2}} if scored else {}
        out = _text(
            http,
            model,
            8,
            stop_token_ids=[ids[stop_at]],
            include_stop_str_in_output=include,
            **extra,
        )
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert out["usage"]["completion_tokens"] == stop_at + 1  # the stop token counts
        kept = _text(http, model, stop_at + 1 if include else stop_at)["choices"][0]["text"]
        assert choice["text"] == kept, (include, scored)
        with http.stream(
            "POST",
            "/v1/completions",
            json={
                "model": model,
                "prompt": PROMPT,
                "temperature": 0,
                "max_tokens": 8,
                "ignore_eos": True,
                "stream": True,
                "stop_token_ids": [ids[stop_at]],
                "include_stop_str_in_output": include,
                **extra,
            },
        ) as r:
            chunks = sse_json(sse_events(r))
        assert "".join(c["choices"][0]["text"] for c in chunks) == kept, (include, scored)


def test_eos_text_left_out_unless_asked(http, model):
    """An EOS that ends a sequence shows no text with skip_special_tokens off, as a stop
    token id (and as vLLM), unless include_stop_str_in_output."""
    for eos in _eos_ids(http):
        for include in (False, True):
            out = _text(
                http,
                model,
                4,
                logit_bias={str(eos): 100},
                skip_special_tokens=False,
                include_stop_str_in_output=include,
                ignore_eos=False,
            )
            choice = out["choices"][0]
            assert choice["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 1
            want = (
                http.post(
                    "/detokenize", json={"tokens": [eos], "skip_special_tokens": False}
                ).json()["prompt"]
                if include
                else ""
            )
            assert want != "" or not include
            assert choice["text"] == want, (eos, include, choice["text"])


def _early_unique_token(tokens: list[str], text: str) -> int:
    """The first token after the first whose text is not blank and occurs once in text."""
    return next(
        i for i in range(1, len(tokens) - 2) if tokens[i].strip() and text.count(tokens[i]) == 1
    )


def test_min_tokens_holds_back_stop_strings(client, http, model):
    """As vLLM: a stop string counts only once the output has more than min_tokens tokens
    (before, a stop string in the first tokens ended the choice short of min_tokens)."""
    out = _text(http, model, 10, logprobs=0)["choices"][0]
    i = _early_unique_token(out["logprobs"]["tokens"], out["text"])
    piece = out["logprobs"]["tokens"][i]
    assert _text(http, model, 10, stop=[piece])["usage"]["completion_tokens"] == i + 1
    held = _text(http, model, 10, stop=[piece], min_tokens=i + 1)["choices"][0]
    assert held["finish_reason"] == "length" and held["text"] == out["text"]
    chat = dict(
        model=model, messages=USER, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.chat.completions.create(logprobs=True, **chat).choices[0]
    i = _early_unique_token([t.token for t in full.logprobs.content], full.message.content)
    piece = full.logprobs.content[i].token
    short = client.chat.completions.create(stop=[piece], **chat)
    assert short.usage.completion_tokens == i + 1
    chat["extra_body"]["min_tokens"] = i + 1
    held = client.chat.completions.create(stop=[piece], **chat).choices[0]
    assert (held.finish_reason, held.message.content) == ("length", full.message.content)


def _unique_piece(text: str) -> str:
    """Two characters, not blank, found once in text and not at its start: a stop string
    that cuts the text partway."""
    return next(
        text[i : i + 2]
        for i in range(1, len(text) - 1)
        if text[i : i + 2].strip() and text.count(text[i : i + 2]) == 1
    )


def test_stop_reason_names_what_stopped_the_choice(client, http, model):
    """vLLM's stop_reason: the stop string or stop token id that ended a choice; null for an
    EOS and for the length limit. In full answers and in the stream's last chunk (completions
    and chat), read through the official client."""
    piece = _unique_piece(_text(http, model, 8)["choices"][0]["text"])
    ids = http.post(
        "/generate",
        json={
            "prompt": PROMPT,
            "generate_config": {
                "max_new_tokens": 8,
                "do_sample": False,
                "ignore_eos": True,
                "return_output_ids": True,
            },
        },
    ).json()["output_ids"]
    stop_id = next(ids[i] for i in range(2, len(ids)) if ids[i] not in ids[:i])
    eos, other_eos = _eos_ids(http)  # the tokenizer's (<|im_end|>), generation_config's other
    cases = [
        (["@@", piece], {}, "stop", piece),
        # rank 0 detects the stop strings of a request scoring its last kept token
        (["@@", piece], {"custom_output_params": {"position": -2}}, "stop", piece),
        (None, {"stop_token_ids": [stop_id]}, "stop", stop_id),
        (None, {}, "length", None),
        # an EOS that is also a stop token id: the EOS is checked first (as vLLM)
        (
            None,
            {"logit_bias": {str(eos): 100}, "stop_token_ids": [eos], "ignore_eos": False},
            "stop",
            None,
        ),
        # the generation config's other EOS id: a stop token id to vLLM, so named
        (None, {"logit_bias": {str(other_eos): 100}, "ignore_eos": False}, "stop", other_eos),
    ]
    for stop, extra, finish, reason in cases:
        kwargs = dict(
            model=model,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            stop=stop,
            extra_body={"ignore_eos": True, **extra},
        )
        choice = client.completions.create(**kwargs).choices[0]
        assert (choice.finish_reason, choice.stop_reason) == (finish, reason), extra
        last = list(client.completions.create(stream=True, **kwargs))[-1].choices[0]
        assert (last.finish_reason, last.stop_reason) == (finish, reason), extra
    chat = dict(
        model=model, messages=USER, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    piece = _unique_piece(client.chat.completions.create(**chat).choices[0].message.content)
    choice = client.chat.completions.create(stop=[piece], **chat).choices[0]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", piece)
    last = list(client.chat.completions.create(stop=[piece], stream=True, **chat))[-1]
    assert (last.choices[0].finish_reason, last.choices[0].stop_reason) == ("stop", piece)


def test_beam_search_ends_hypotheses_at_stop_token_ids(http):
    """A stop token id ends a beam hypothesis as an EOS does, its text left out as for
    sampling (before, beams ran past it to the length limit)."""
    config = {"max_new_tokens": 6, "num_beams": 2, "ignore_eos": True, "return_output_ids": True}
    free = http.post("/generate", json={"prompt": PROMPT, "generate_config": config}).json()
    beam = free["output_ids"][0]
    stop = next(t for i, t in enumerate(beam) if i >= 1 and t not in beam[:i])
    # a negative length penalty ranks short hypotheses first: those ended by the stop id
    r = http.post(
        "/generate",
        json={
            "prompt": PROMPT,
            "generate_config": {**config, "stop_token_ids": [stop], "length_penalty": -2.0},
        },
    ).json()
    for ids, text in zip(r["output_ids"], r["response"]):
        assert stop not in ids[:-1], ids  # nothing after a stop id
        if ids[-1] == stop:
            want = http.post("/detokenize", json={"tokens": ids[:-1]}).json()["prompt"]
            assert text == want, (ids, text)
    assert any(ids[-1] == stop for ids in r["output_ids"]), (stop, free["output_ids"], r)


def test_rank0_cuts_where_the_api_does_when_a_stop_id_ends_the_text(http, model):
    """LAST_GENERATED with stop strings: rank 0 looks for them itself. A stop string that
    would span into a stop token id's text is not in the API's text (that text is left out),
    so neither may rank 0 cut there: the choice ends at the stop id, and the value scores the
    same token as without the stop string."""
    out = _text(http, model, 10, logprobs=0)["choices"][0]
    tokens = out["logprobs"]["tokens"]
    ids = http.post(
        "/generate",
        json={
            "prompt": PROMPT,
            "generate_config": {
                "max_new_tokens": 10,
                "do_sample": False,
                "ignore_eos": True,
                "return_output_ids": True,
            },
        },
    ).json()["output_ids"]
    j = next(
        j
        for j in range(2, 9)
        if ids[j] not in ids[:j]
        and tokens[j - 1]
        and tokens[j]
        and tokens[j - 1][-1] + tokens[j][0] not in "".join(tokens[:j])
    )
    span = tokens[j - 1][-1] + tokens[j][0]
    scored = {"custom_output_params": {"position": -2}}
    plain = _text(http, model, 10, stop_token_ids=[ids[j]], **scored)
    spanning = _text(http, model, 10, stop_token_ids=[ids[j]], stop=[span], **scored)
    for body in (plain, spanning):
        choice = body["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ids[j]), body
        assert body["usage"]["completion_tokens"] == j + 1
    assert spanning["choices"][0]["text"] == plain["choices"][0]["text"]
    assert spanning["extra_outputs"] == plain["extra_outputs"]
