"""What outside clients found, pinned on a live server (`python launch.py`, CPU, demo model;
fixtures in tests/helpers/api.py); how a choice ends (stop ids, EOS text, stop_reason,
min_tokens, beams) is in tests/api/test_api_stops.py. 2026-11-30's: malformed chat fields
are 605s, not 500s; token ids outside the vocabulary and min_tokens above the limit are 605s;
`continuous_usage_stats` puts the usage in every chunk; a client that gives up (a request
waiting, a stream, an upload) is a 499 in the metrics, not a 500 nor missing; a request
larger than the queue is a 605, not a 503; chat logprobs' `bytes` are each token's own
bytes; JSON types are checked strictly (as OpenAI). 2026-11-30's: a tiny temperature
sampling token 0, unchecked logit_bias values, null rejected for nullable fields, the default
max_tokens refused where it did not fit, and smaller gaps. 2026-11-30's: continuous
usage summing every choice, and continue_final_message with an explicit
add_generation_prompt. 2026-12-01's: text parts glued together, completions logprobs
over characters split across tokens."""

from __future__ import annotations

import httpx
import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tests.helpers import wait_for  # noqa: E402
from tests.helpers.api import requests_total, sse_events, sse_json  # noqa: E402

pytest_plugins = ["tests.helpers.api"]
PROMPT = "The quick brown fox jumps over the lazy dog."
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def model(client) -> str:
    return client.models.list().data[0].id


def _assert_605(r: httpx.Response, what: str) -> None:
    assert r.status_code == 400, (what, r.status_code, r.text[:300])
    body = r.json()
    code = body.get("error_code") or body["error"]["code"]
    assert code in (605, "605_INVALID_PARAMS"), (what, body)


def test_malformed_chat_fields_are_605(http, model):
    bad_parts = [
        [{"type": "text"}],
        [{"type": "text", "text": 5}],
        [{"type": "text", "text": "a", "extra": 1}],
    ]
    bad_kwargs = [{"add_generation_prompt": 5}, {"messages": []}, {"bos_token": "x"}, {"self": 1}]
    for path, base in (
        ("/v1/chat/completions", {"model": model}),
        ("/tokenize", {}),
        ("/generate", {}),
    ):
        for parts in bad_parts:
            r = http.post(path, json={**base, "messages": [{"role": "user", "content": parts}]})
            _assert_605(r, f"{path} {parts}")
        for kwargs in bad_kwargs:
            r = http.post(path, json={**base, "messages": USER, "chat_template_kwargs": kwargs})
            _assert_605(r, f"{path} {kwargs}")
    ok = http.post(
        "/tokenize",
        json={"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
    )
    assert (
        ok.status_code == 200
        and ok.json()["tokens"] == http.post("/tokenize", json={"messages": USER}).json()["tokens"]
    )


def test_an_empty_stop_string_is_605(http, model):
    """As vLLM ("stop cannot contain an empty string"); found by an outside tester: "" was
    dropped without a word."""
    for stop in ("", ["x", ""]):
        r = http.post(
            "/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 2, "stop": stop}
        )
        _assert_605(r, f"completions stop={stop!r}")
        assert "stop" in r.json()["error"]["message"], r.text
    r = http.post("/generate", json={"prompt": "a", "generate_config": {"stop_words_str": [""]}})
    _assert_605(r, "generate stop_words_str")
    ok = http.post(
        "/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 2, "stop": ["x"]}
    )
    assert ok.status_code == 200, ok.text


def test_a_request_msgpack_cannot_carry_names_its_field(http, model):
    """Found by an outside tester: these 605s came with `param: null`."""
    base = {"model": model, "prompt": "a", "max_tokens": 2}
    r = http.post("/v1/completions", json={**base, "custom_output_params": {"position": 10**29}})
    _assert_605(r, "an integer beyond 64 bits")
    assert r.json()["error"]["param"] == "custom_output_params", r.text
    r = http.post(
        "/v1/completions",
        headers={"content-type": "application/json"},
        content=b'{"model": "%s", "prompt": "a", "max_tokens": 2, "stop": "\\udc00"}'
        % model.encode(),
    )
    _assert_605(r, "a lone surrogate")
    assert r.json()["error"]["param"] == "stop" and "not valid Unicode" in r.text, r.text


def test_text_parts_are_joined_by_newlines(http, model):
    """Several text parts of one message reach the template joined by "\n", as vLLM joins
    them (they were glued: "Hello" + "world" became "Helloworld")."""
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}],
        }
    ]
    joined = [{"role": "user", "content": "Hello\nworld"}]
    tokens = http.post("/tokenize", json={"messages": parts}).json()["tokens"]
    assert tokens == http.post("/tokenize", json={"messages": joined}).json()["tokens"]
    usage = [
        http.post(
            "/v1/chat/completions", json={"model": model, "messages": m, "max_tokens": 1}
        ).json()["usage"]
        for m in (parts, joined)
    ]
    assert usage[0]["prompt_tokens"] == usage[1]["prompt_tokens"] == len(tokens)


def test_ids_outside_the_vocabulary_and_min_tokens_are_605(http, model):
    base = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    # keys that int() would read as ids (an outside tester's find): underscores, spaces,
    # other scripts' digits
    for extra in (
        {"logit_bias": {"-1": 5}},
        {"logit_bias": {str(10**6): 5}},
        {"logit_bias": {"5_0": 5}},
        {"logit_bias": {" 5": 5}},
        {"logit_bias": {"\u0663": 5}},
        {"logit_bias": {"5": 1, "": 5}},
        {"logit_bias": {"9" * 5000: 5}},  # (beyond int()'s 4300 digits: was a 500)
        {"stop_token_ids": [10**6]},
        {"min_tokens": 10},
    ):
        _assert_605(http.post("/v1/completions", json={**base, **extra}), str(extra))
    assert http.post("/v1/completions", json={**base, "logit_bias": {"5": 1}}).status_code == 200


def _text(http, model, max_tokens: int, **extra) -> dict:
    r = http.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "temperature": 0,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_continuous_usage_stats_in_every_chunk(http, model):
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = sse_json(sse_events(r))
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and counts == sorted(counts) and counts[-1] == 5
    assert len({c["usage"]["prompt_tokens"] for c in chunks}) == 1
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = sse_json(sse_events(r))
    # as OpenAI: every chunk has the key, null until the closing usage chunk
    assert all("usage" in c for c in chunks)
    assert [c["usage"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_continuous_usage_is_each_choices_own(http, model):
    """With n > 1 a chunk's usage counts its own choice's streamed tokens (as vLLM), not
    every choice's; the closing usage chunk counts them all."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 6,
        "ignore_eos": True,
        "n": 3,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = sse_json(sse_events(r))
    streamed = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        streamed[choice["index"]] = streamed.get(choice["index"], 0) + len(
            choice["logprobs"]["tokens"]
        )
        assert c["usage"]["completion_tokens"] == streamed[choice["index"]], c
    assert streamed == {0: 6, 1: 6, 2: 6}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 18


def test_client_that_gives_up_is_499_not_500(server, model):
    before_500, before_499 = requests_total(server, "500"), requests_total(server, "499")
    body = {"model": model, "prompt": PROMPT * 4, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=1.0)
    assert wait_for(lambda: requests_total(server, "499") == before_499 + 1, 60), server.log_tail()
    assert requests_total(server, "500") == before_500
    assert "ClientGone" not in server.log_tail(20000)


def test_chat_logprob_bytes_are_the_tokens_own(client, model):
    from tapserve.api.tokenizer import TextTokenizer
    from tapserve.model.demo import ensure_demo_checkpoint

    tok = TextTokenizer.from_dir(ensure_demo_checkpoint())
    text = "naïve café ☃ 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    assert any(_not_utf8(p) for p in pieces)  # a character split across tokens
    r = client.chat.completions.create(
        model=model, messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    for item in r.choices[0].logprobs.content:
        for entry in (item, *item.top_logprobs):
            assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token, entry


def _not_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_wrong_json_types_are_605_not_coerced(http, model):
    """As OpenAI: a string is not a number or a bool, a bool is not a token id."""
    base = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    for extra in (
        {"max_tokens": "5"},
        {"stream": "yes"},
        {"prompt": [True, False]},
        {"n": 1.0},
        {"temperature": "0.5"},
    ):
        _assert_605(http.post("/v1/completions", json={**base, **extra}), str(extra))
    _assert_605(
        http.post("/generate", json={"prompt": PROMPT, "generate_config": {"max_new_tokens": "2"}}),
        "generate_config.max_new_tokens",
    )
    ok = http.post("/v1/completions", json={**base, "temperature": 0, "top_p": 1})
    assert ok.status_code == 200  # JSON integers stand for floats


def test_cancelled_streams_and_cut_uploads_count_as_499(server, model):
    import socket
    from urllib.parse import urlparse

    before_499, before_400 = requests_total(server, "499"), requests_total(server, "400")
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=30
    ) as r:
        assert next(r.iter_lines()).startswith("data: ")  # in flight, then the client leaves
    assert wait_for(lambda: requests_total(server, "499") == before_499 + 1, 60), server.log_tail()
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port)) as s:  # half a body, then gone
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: 86\r\nAuthorization: "
            + server.headers.get("Authorization", "none").encode()
            + b"\r\n\r\n"
            + b'{"prompt": "abc", "m'
        )
    assert wait_for(lambda: requests_total(server, "499") == before_499 + 2, 60)
    assert requests_total(server, "400") == before_400


def test_a_request_larger_than_the_queue_is_605_not_503(http, model):
    r = http.post("/v1/completions", json={"model": model, "prompt": ["x"] * 1000, "max_tokens": 1})
    _assert_605(r, "1000 prompts")
    assert "admits at most" in r.json()["error"]["message"]


def test_api_process_answers_open_streams_when_rank0_dies(tmp_path):
    """The API process runs in a session of its own; it watches rank 0 by the pid rank 0
    gives it (not its own getppid(), which may already be 1), and when rank 0 is killed it
    ends the open streams with the 503 envelope before it stops, and removes rank 0's ipc
    dir (it was left behind)."""
    import os
    import signal

    from tests.helpers.api import LiveServer
    from tests.helpers.procs import api_pid, cmdline, exited, flag_value

    server = LiveServer()
    try:
        api = api_pid(server.proc.pid)
        argv = cmdline(api)
        assert flag_value(argv, "--parent-pid") == str(server.proc.pid)
        ipc_dir = flag_value(argv, "--ipc-dir")
        body = {
            "model": "tapserve-demo",
            "prompt": PROMPT,
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=30
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(server.proc.pid, signal.SIGKILL)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert '"503_SERVICE_UNAVAILABLE"' in events[-1], events[-2:]
        assert wait_for(lambda: exited(api), 60)
        assert not os.path.exists(ipc_dir), os.listdir(ipc_dir)  # rank 0 could not remove it
    finally:
        server.stop()


def test_chunked_prefill_streams_no_empty_chunks():
    """A prompt prefilled in several chunks (budget 16 tokens) streams no chunk before its
    first token: a max_tokens=0 stream is one chunk with the value, and every chunk of a
    chat stream carries text or a finish and the value. Each prefill chunk before the last
    sent an empty chunk without the value."""
    import json

    from tests.helpers.api import LiveServer

    server = LiveServer("--max-num-batched-tokens", "16")
    try:
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
            body = {"model": "tapserve-demo", "prompt": PROMPT * 5, "max_tokens": 0, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                events = sse_events(r)
            assert events[-1] == "[DONE]" and len(events) == 2, events
            only = json.loads(events[0])
            assert only["choices"][0]["finish_reason"] == "length"
            assert only["extra_outputs"]["custom_output"]
            body = {
                "model": "tapserve-demo",
                "messages": [{"role": "user", "content": PROMPT * 5}],
                "max_tokens": 3,
                "n": 2,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0,
            }
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                chunks = sse_json(sse_events(r))
            assert len(chunks) >= 2
            for c in chunks:
                choice = c["choices"][0]
                assert choice["delta"].get("content") or choice["finish_reason"], c
                assert c["extra_outputs"]["custom_output"], c
            firsts = {c["choices"][0]["index"]: c for c in reversed(chunks)}
            assert all(c["choices"][0]["delta"]["role"] == "assistant" for c in firsts.values())
    finally:
        server.stop()


# ---- what an outside client found (2026-11-30) -----------------------------------------


def _eos_ids(http) -> list[int]:
    ids = [
        http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        for text in ("<|im_end|>", "<|endoftext|>")
    ]
    assert all(len(t) == 1 for t in ids), ids  # the demo's two EOS tokens, one id each
    return [t[0] for t in ids]


def test_a_tiny_temperature_is_greedy_and_non_finite_values_are_605(http, model):
    """1/T overflowed below ~1e-38 and the sampler fell back to token 0: below 1e-5 a
    temperature samples greedily (as vLLM). Infinite temperatures and penalties, and logit
    biases outside OpenAI's [-100, 100] (NaN, inf included) are 605s."""
    greedy = _text(http, model, 6)["choices"][0]["text"]
    for t in (1e-38, 1e-45, 1e-6):
        out = _text(http, model, 6, temperature=t, seed=3)
        assert out["choices"][0]["text"] == greedy, t
    base = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    for extra in (
        '"temperature": Infinity',
        '"temperature": 1e400',
        '"repetition_penalty": Infinity',
        '"logit_bias": {"5": 101}',
        '"logit_bias": {"5": -1e400}',
        '"logit_bias": {"5": NaN}',
    ):
        raw = f'{{"model": "{model}", "prompt": "hi", "max_tokens": 2, {extra}}}'
        _assert_605(
            http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
            extra,
        )
    assert http.post("/v1/completions", json={**base, "logit_bias": {"5": -100}}).status_code == 200


def test_null_means_the_default(client, http, model):
    """The official client sends n=None as "n": null: the default, as OpenAI documents."""
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        n=None,
        stream=None,
        echo=None,
        presence_penalty=None,
    )
    assert out.choices[0].text == _text(http, model, 3)["choices"][0]["text"]
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": model,
            "messages": USER,
            "max_tokens": 2,
            "logprobs": None,
            "tools": None,
            "stream": None,
            "frequency_penalty": None,
        },
    )
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1
    _assert_605(
        http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "n": "2"}),
        "a string n is still wrong",
    )


def test_the_default_max_tokens_fits_the_context(http, model):
    """Without max_tokens, OpenAI's default of 16 is cut to the room the prompt leaves;
    an explicit max_tokens that does not fit stays a 605."""
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    prompt = [5] * (limit - 4)
    out = http.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "temperature": 0, "ignore_eos": True},
    )
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["completion_tokens"] == 4
    _assert_605(
        http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16}),
        "explicit max_tokens",
    )


def test_continue_final_message_with_an_explicit_generation_prompt_is_605(http, model):
    messages = USER + [{"role": "assistant", "content": "Hel"}]
    body = {"model": model, "messages": messages, "max_tokens": 2, "continue_final_message": True}
    _assert_605(
        http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True}), "both set"
    )
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    tokens = http.post("/tokenize", json={"messages": messages, "continue_final_message": True})
    assert tokens.status_code == 200, tokens.text  # /tokenize takes the field too, as vLLM
    assert tokens.json()["count"] == r.json()["usage"]["prompt_tokens"]
    assert "".join(tokens.json()["token_strs"]).endswith("assistant\nHel")  # no end-of-turn


def test_stream_options_without_stream_bad_utf8_and_model_retrieval(http, model):
    _assert_605(
        http.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": PROMPT,
                "max_tokens": 2,
                "stream_options": {"include_usage": True},
            },
        ),
        "stream_options without stream",
    )
    _assert_605(
        http.post(
            "/v1/completions",
            content=b'{"prompt": "\xff\xfe"}',
            headers={"content-type": "application/json"},
        ),
        "invalid UTF-8",
    )
    card = http.get(f"/v1/models/{model}")
    assert card.status_code == 200 and card.json()["id"] == model
    assert card.json()["created"] > 1.7e9  # a Unix time, as OpenAI's and vLLM's cards
    assert card.json() == http.get("/v1/models").json()["data"][0]
    assert http.get("/v1/models/no-such-model").status_code == 404


def test_completion_logprobs_over_characters_split_across_tokens(http, model):
    """The demo model emits byte tokens, parts of one character. Each text_offset is where
    its token's text begins in the choice's text (they drifted by one per such character);
    such tokens are named `bytes:\\xNN` as OpenAI's legacy API names them, so top_logprobs
    keeps every entry and the sampled token's own logprob (as U+FFFD text they overwrote
    one another). Streamed equals non-streamed."""
    body = {
        "model": model,
        "prompt": ["Café in 中国 é", "naïve résumé 日本語"],
        "n": 8,
        "max_tokens": 60,
        "temperature": 1.2,
        "seed": 1,
        "logprobs": 5,
    }
    full = http.post("/v1/completions", json=body).json()["choices"]
    split = 0
    for c in full:
        text, lp = c["text"], c["logprobs"]
        assert lp["text_offset"] == sorted(lp["text_offset"]), c["index"]
        rows = list(zip(lp["tokens"], lp["text_offset"], lp["top_logprobs"], lp["token_logprobs"]))
        for k, (token, offset, top, own) in enumerate(rows):
            assert len(top) in (5, 6) and top[token] == own, (c["index"], k, token, top)
            if token.startswith("bytes:"):
                split += 1
            elif not (k == len(rows) - 1 and c["finish_reason"] == "stop"):  # (an EOS' text)
                assert text.startswith(token, offset), (c["index"], k, token, offset)
    assert split > 10  # the case is exercised
    streamed: dict[int, dict] = {}
    for chunk in sse_json(sse_events(http.post("/v1/completions", json={**body, "stream": True}))):
        for ch in chunk["choices"]:
            s = streamed.setdefault(ch["index"], {"tokens": [], "text_offset": [], "top": []})
            lp = ch["logprobs"] or {"tokens": [], "text_offset": [], "top_logprobs": []}
            s["tokens"] += lp["tokens"]
            s["text_offset"] += lp["text_offset"]
            s["top"] += lp["top_logprobs"]
    for c in full:  # (another run's batches: logprobs equal up to float noise)
        s = streamed[c["index"]]
        assert (s["tokens"], s["text_offset"]) == (
            c["logprobs"]["tokens"],
            c["logprobs"]["text_offset"],
        )
        for got, want in zip(s["top"], c["logprobs"]["top_logprobs"]):
            assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-4 for k in got)


def test_tokenize_and_detokenize_take_the_model_field(http, model):
    """As vLLM's: `model` may be given (it was a 400, "unsupported field"); another model's
    name is a 404, as on /v1/completions."""
    r = http.post("/tokenize", json={"model": model, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens == http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    back = http.post("/detokenize", json={"model": model, "tokens": tokens})
    assert back.status_code == 200 and back.json()["prompt"] == PROMPT
    for path, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": tokens})):
        r = http.post(path, json={**body, "model": "not-" + model})
        assert r.status_code == 404 and "not-" + model in r.json()["message"], (path, r.text)


def test_tool_messages_take_tool_call_id(http, model):
    """OpenAI's tool messages carry `tool_call_id` (required in its schema): accepted and
    handed to the template, as vLLM does; it was a 400."""
    messages = USER + [
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    r = http.post(
        "/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 1}
    )
    assert r.status_code == 200, r.text
    without = [*messages[:-1], {"role": "tool", "content": "42"}]
    same = http.post("/tokenize", json={"messages": without}).json()["tokens"]
    assert http.post("/tokenize", json={"messages": messages}).json()["tokens"] == same
    assert r.json()["usage"]["prompt_tokens"] == len(same)


def test_engine_refusals_name_the_field(client, model):
    """A 605 that the engine decides (the selector's position, a scoring-only request that
    selects nothing) names its field as the OpenAI request spells it (param was null, and
    the message spoke of max_new_tokens, the engine's name)."""
    import openai

    cases = [
        (
            "completions",
            {
                "prompt": PROMPT,
                "max_tokens": 2,
                "extra_body": {"custom_output_params": {"position": 999}},
            },
            "custom_output_params",
        ),
        (
            "completions",
            {
                "prompt": PROMPT,
                "max_tokens": 0,
                "extra_body": {"custom_output_params": {"position": -1}},
            },
            "max_tokens",
        ),
        (
            "chat.completions",
            {
                "messages": USER,
                "max_tokens": 0,
                "extra_body": {"custom_output_params": {"position": -1}},
            },
            "max_tokens",
        ),
        (
            "chat.completions",
            {
                "messages": USER,
                "max_completion_tokens": 0,  # (a reviewer)
                "extra_body": {"custom_output_params": {"position": -1}},
            },
            "max_completion_tokens",
        ),
    ]
    for api, kwargs, param in cases:
        create = (
            client.completions.create if api == "completions" else client.chat.completions.create
        )
        with pytest.raises(openai.BadRequestError) as e:
            create(model=model, **kwargs)
        error = e.value.body
        assert error["param"] == param and error["code"] == "605_INVALID_PARAMS", (api, error)
        assert "max_new_tokens" not in error["message"], error
