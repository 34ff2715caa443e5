"""Multi-row custom outputs end to end (DESIGN.md "Custom outputs over many tokens"): the real
`launch.py` serving a tiny float32 Qwen3 checkpoint with `GatedProbe` (StopProbe's linear head
on test_head.*, which a test can pace step by step in a stream), driven over HTTP with the
official `openai` client and httpx. Every row is checked against transformers' final hidden
state of prompt + returned ids at its position; the streaming rule (each chunk carries exactly
the rows of its tokens) on every chunk; the moderation stop, stop strings, native /generate and
/custom_output, and prefix reuse.

Two servers: `recompute` (no selected prompt row is ever lost to reuse, so a request and its
repeat compare) and `omit` (the prefix-reuse tests)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import tokenizers

from tapserve.api.tokenizer import TextTokenizer
from tests.helpers import wait_for
from tests.helpers.api import LiveServer
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.custom import Reference, head_tensors, prompt
from tests.helpers.rows_live import (
    Gate,
    assert_rows,
    chat_ids_of,
    extra_of,
    gated_stream,
    ids_of,
    stop_string_at,
    stream_rows,
)

pytest.importorskip("transformers")

MODEL = "m"
ALL = -3


# ---- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("rows-live") / "m",
        "qwen3",
        tokenizer=True,
        extra_tensors=head_tensors(),
    )


@pytest.fixture(scope="module")
def ref(ckpt) -> Reference:
    return Reference(ckpt)


@pytest.fixture(scope="module")
def names(ckpt) -> dict:
    """Token ids by their names in legacy completions logprobs and by chat logprobs' bytes
    (both one-to-one for the demo tokenizer: checked here)."""
    tok = TextTokenizer.from_dir(ckpt)
    vocab = tok.tokenizer.get_vocab_size()
    legacy = {tok.legacy_token_str(i): i for i in range(vocab)}
    by_bytes = {bytes(tok.token_bytes(i)): i for i in range(vocab)}
    assert len(legacy) == vocab and len(by_bytes) == vocab
    return {"legacy": legacy, "bytes": by_bytes}


@pytest.fixture(scope="module")
def decode(ckpt):
    tok = tokenizers.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _serve(ckpt, policy: str, *extra: str):
    server = LiveServer(
        "--model",
        str(ckpt),
        "--served-model-name",
        MODEL,
        "--custom-module",
        "tests.helpers.rows_live:GatedProbe",
        "--custom-output-reuse",
        policy,
        "--block-size",
        "8",
        "--num-kv-blocks",
        "128",
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "32",
        *extra,
    )
    yield server
    assert server.stop() == 0, server.log_tail()


@pytest.fixture(scope="module")
def recompute(ckpt):
    yield from _serve(ckpt, "recompute")


@pytest.fixture(scope="module")
def omit(ckpt):
    yield from _serve(ckpt, "omit")


@pytest.fixture(scope="module")
def ahead(ckpt):
    yield from _serve(ckpt, "omit", "--async-scheduling")


def client_of(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---- 1. completions, n = 2, seeded, streamed with logprobs --------------------------------------
def test_completions_n2_stream_chunks_carry_their_rows(recompute, ref, names, decode, tmp_path):
    client = client_of(recompute)
    gate = Gate(tmp_path / "gate")
    ids = prompt(20, 101)
    cop = {"position": [11, 3, ALL]}  # served ascending
    kwargs = dict(
        model=MODEL,
        prompt=ids,
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=7,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(
        **{**kwargs, "extra_body": {"custom_output_params": cop, "ignore_eos": True}}
    )
    assert whole.usage.completion_tokens == 12
    answer = {}
    for choice in whole.choices:
        out = ids_of(names, choice.logprobs)
        assert len(out) == 6 and decode(out) == choice.text
        extra = extra_of(choice)
        positions = [3, 11, *range(20, 26)]
        assert extra["custom_output_positions"] == positions
        assert_rows(ref, ids + out, positions, extra["custom_output"])
        answer[choice.index] = (out, extra)
    assert answer[0][0] != answer[1][0]  # two samples, rows of each its own
    assert extra_of(whole) == answer[1][1]  # top level: the last choice's

    chunks = gated_stream(gate, client.completions.create, cop, **kwargs)
    seen = stream_rows(chunks, [3, 11], 20, lambda lp: ids_of(names, lp))
    assert sorted(seen) == [0, 1]
    for index, (out, extra) in answer.items():
        mine = seen[index]
        assert mine["chunks"] >= 3, mine  # deltas, not the whole value at the end
        assert mine["ids"] == out and mine["finish"] == "length"
        assert mine["pos"] == extra["custom_output_positions"]
        assert mine["rows"] == extra["custom_output"]


# ---- 2. chat completions with -3 ------------------------------------------------------------
def test_chat_every_generated_token(recompute, ref, names, tmp_path):
    client = client_of(recompute)
    gate = Gate(tmp_path / "gate")
    messages = [{"role": "user", "content": "score each token you write"}]
    prompt_ids = httpx.post(
        recompute.url + "/tokenize", json={"messages": messages}, timeout=30
    ).json()["tokens"]
    n_prompt = len(prompt_ids)
    kwargs = dict(
        model=MODEL,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        extra_body={"custom_output_params": {"position": [ALL]}, "ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    assert whole.usage.prompt_tokens == n_prompt
    (choice,) = whole.choices
    out = chat_ids_of(names, choice.logprobs)
    assert len(out) == whole.usage.completion_tokens == 5
    extra = extra_of(choice)
    positions = list(range(n_prompt, n_prompt + 5))
    assert extra["custom_output_positions"] == positions
    assert_rows(ref, prompt_ids + out, positions, extra["custom_output"])
    assert extra_of(whole) == extra

    kwargs["extra_body"] = {"ignore_eos": True}
    chunks = gated_stream(gate, client.chat.completions.create, {"position": [ALL]}, **kwargs)
    seen = stream_rows(chunks, [], n_prompt, lambda lp: chat_ids_of(names, lp))
    assert seen[0]["chunks"] >= 3 and seen[0]["ids"] == out
    assert seen[0]["text"] == choice.message.content
    assert seen[0]["pos"] == positions
    # (the repeat reuses the cached prompt: its rows may differ from the first in rounding)
    assert_rows(ref, prompt_ids + out, positions, seen[0]["rows"])


# ---- 3. a head that stops the stream ----------------------------------------------------------
def test_moderation_stream_never_shows_the_flagged_token(recompute, ref, names, decode, tmp_path):
    client = client_of(recompute)
    ids = prompt(18, 122)  # its first tokens are whole characters: no held bytes
    common = dict(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=1)
    free = client.completions.create(
        **common, extra_body={"custom_output_params": {"position": [ALL]}, "ignore_eos": True}
    )
    (choice,) = free.choices
    tokens = ids_of(names, choice.logprobs)
    scores = [row[0] for row in extra_of(choice)["custom_output"]]
    assert len(tokens) == len(scores) == 8 and choice.finish_reason == "length"
    # flag the first token whose score passes all earlier ones
    k = next((i for i in range(2, 7) if scores[i] > max(scores[:i])), None)
    assert k is not None, f"no rising score to flag in {scores}"
    shown, flagged = decode(tokens[:k]), decode(tokens[: k + 1])
    assert "\ufffd" not in flagged and len(flagged) > len(shown)  # the flagged token has text
    # halfway between: the repeat reuses the cached prompt, its rows may differ in rounding
    cop = {"position": [ALL], "threshold": (scores[k] + max(scores[:k])) / 2}
    chunks = gated_stream(
        Gate(tmp_path / "gate"),
        client.completions.create,
        cop,
        **common,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    seen = stream_rows(chunks, [], 18, lambda lp: ids_of(names, lp))
    mine = seen[0]
    assert mine["finish"] == "content_filter"
    assert mine["ids"] == tokens[:k]  # no logprobs entry (nor id) for the flagged token
    assert mine["text"] == shown  # no chunk held any of the flagged token's text
    assert chunks[-1].usage.completion_tokens == k + 1  # it counts in usage
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert extra_of(final.choices[0])["custom_output_positions"][-1] == 18 + k
    assert mine["pos"] == list(range(18, 18 + k + 1))
    assert_rows(ref, ids + tokens[: k + 1], mine["pos"], mine["rows"])


# ---- 4. stop strings with -3 --------------------------------------------------------------------
def test_stop_string_rows_match_completion_tokens(recompute, ref, names, decode, tmp_path):
    client = client_of(recompute)
    ids = prompt(18, 124)  # its greedy answer varies: a stop string can end at one token
    extra_body = {"custom_output_params": {"position": [ALL]}, "ignore_eos": True}
    common = dict(model=MODEL, prompt=ids, max_tokens=10, temperature=0, logprobs=1)
    free = client.completions.create(**common, extra_body=extra_body)
    tokens = ids_of(names, free.choices[0].logprobs)
    j, stop = stop_string_at(decode, tokens)
    stopped = client.completions.create(**common, stop=[stop], extra_body=extra_body)
    (choice,) = stopped.choices
    assert choice.finish_reason == "stop", (choice, stop)
    assert stopped.usage.completion_tokens == j + 1
    full = decode(tokens[: j + 1])
    assert choice.text == full[: full.find(stop)]
    extra = extra_of(choice)
    positions = list(range(18, 18 + j + 1))  # the token completing the stop string included
    assert extra["custom_output_positions"] == positions
    assert_rows(ref, ids + tokens[: j + 1], positions, extra["custom_output"])
    chunks = gated_stream(
        Gate(tmp_path / "gate"),
        client.completions.create,
        {"position": [ALL]},
        **common,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    mine = stream_rows(chunks, [], 18, lambda lp: ids_of(names, lp))[0]
    assert mine["finish"] == "stop" and mine["text"] == choice.text
    assert mine["ids"] == tokens[: j + 1] and mine["pos"] == positions
    assert_rows(ref, ids + tokens[: j + 1], positions, mine["rows"])


# ---- 5. native /generate and /custom_output -------------------------------------------------------
def test_generate_rows_per_sequence_json_and_base64(recompute, ref):
    ids = prompt(21, 105)
    body = {
        "input_ids": ids,
        "generate_config": {
            "max_new_tokens": 4,
            "num_return_sequences": 2,
            "do_sample": True,
            "temperature": 1.0,
            "seed": 11,
            "ignore_eos": True,
            "return_output_ids": True,
        },
        "custom_output_params": {"position": [5, 0, ALL]},
    }
    as_json = httpx.post(recompute.url + "/generate", json=body, timeout=120)
    as_b64 = httpx.post(
        recompute.url + "/generate", json={**body, "custom_output_encoding": "base64"}, timeout=120
    )
    assert as_json.status_code == as_b64.status_code == 200, (as_json.text, as_b64.text)
    as_json, as_b64 = as_json.json(), as_b64.json()
    assert as_json["output_ids"] == as_b64["output_ids"]  # seeded: the same tokens
    for seq, out in enumerate(as_json["output_ids"]):
        positions = [0, 5, *range(21, 25)]
        assert len(out) == 4
        assert as_json["custom_output_positions"][seq] == positions
        assert as_b64["custom_output_positions"][seq] == positions
        assert_rows(ref, ids + out, positions, as_json["custom_output"][seq])
        value = as_b64["custom_output"][seq]
        assert value["dtype"] == "float32" and value["shape"] == [6, 3]
        exact = np.array(as_json["custom_output"][seq], "<f4").tobytes()
        assert base64.b64decode(value["data"]) == exact  # JSON floats round-trip float32


def test_custom_output_batch_scores_16_positions_per_prompt(recompute, ref):
    prompts = [prompt(24, 106), prompt(30, 107)]
    rng = np.random.default_rng(0)
    chosen = [rng.choice(len(p), 16, replace=False).tolist() for p in prompts]  # unordered
    body = {"prompts": prompts, "custom_output_params": [{"position": c} for c in chosen]}
    r = httpx.post(recompute.url + "/custom_output", json=body, timeout=120)
    assert r.status_code == 200, r.text
    outputs = r.json()["outputs"]
    assert len(outputs) == 2
    for ids, positions, out in zip(prompts, chosen, outputs):
        assert out["input_len"] == len(ids)
        assert out["custom_output_positions"] == sorted(positions)
        assert_rows(ref, ids, sorted(positions), out["custom_output"])


# ---- 6. prefix reuse and bad lists -----------------------------------------------------------------
@pytest.mark.parametrize("policy", ["omit", "recompute"])
def test_prefix_reuse_policies(policy, request, ref, names):
    server = request.getfixturevalue(policy)
    ids = prompt(40, 108)  # 5 full blocks of 8
    body = {
        "model": MODEL,
        "prompt": ids,
        "max_tokens": 2,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
        "custom_output_params": {"position": [3, 20, 39, ALL]},
    }
    first, second = (
        httpx.post(server.url + "/v1/completions", json=body, timeout=120) for _ in range(2)
    )
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    first, second = first.json(), second.json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    extra = first["choices"][0]["extra_outputs"]
    assert extra["custom_output_positions"] == [3, 20, 39, 40, 41]
    assert "custom_output_omitted" not in extra
    full = ids + [names["legacy"][t] for t in first["choices"][0]["logprobs"]["tokens"]]
    assert_rows(ref, full, [3, 20, 39, 40, 41], extra["custom_output"])
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    extra = second["choices"][0]["extra_outputs"]
    if policy == "omit":
        assert cached > 20
        kept = [p for p in (3, 20, 39) if p >= cached] + [40, 41]
        assert extra["custom_output_positions"] == kept == [39, 40, 41]
        assert extra["custom_output_omitted"] == "prefix_reuse"
        assert second["extra_outputs"]["custom_output_omitted"] == "prefix_reuse"
    else:  # reuse stops below the lowest selected position
        assert cached <= 3
        kept = [3, 20, 39, 40, 41]
        assert extra["custom_output_positions"] == kept
        assert "custom_output_omitted" not in extra
    assert_rows(ref, full, kept, extra["custom_output"])


@pytest.mark.parametrize(
    "selection, seed", [([3, 3], 109), ([-2, -3], 110)], ids=["repeats", "both-generated"]
)
def test_bad_lists_are_400_and_the_server_goes_on(omit, selection, seed):
    body = {
        "model": MODEL,
        "prompt": prompt(12, seed),
        "max_tokens": 2,
        "custom_output_params": {"position": selection},
    }
    r = httpx.post(omit.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "custom_output_params" and error["code"] == "605_INVALID_PARAMS"
    with httpx.stream(
        "POST", omit.url + "/v1/completions", json={**body, "stream": True}, timeout=60
    ) as streamed:  # known before the first token: a plain answer, not an event stream
        streamed.read()
        assert streamed.status_code == 400
        assert streamed.json()["error"]["param"] == "custom_output_params"
    ok = httpx.post(
        omit.url + "/v1/completions",
        json={**body, "custom_output_params": {"position": [3, ALL]}},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["extra_outputs"]["custom_output_positions"][0] == 3


# ---- 7. running ahead: tokens and their rows in the outputs' row columns -------------------------
def test_every_generated_token_running_ahead(ahead, ref):
    """With asynchronous scheduling a plain -3 request runs ahead and each token leaves rank 0
    with its row in wire.Outputs' row columns: the stream's chunks carry their own rows, they
    reassemble to the non-streamed answer, and the rows match transformers."""
    ids = prompt(19, 107)
    body = {
        "input_ids": ids,
        "generate_config": {
            "max_new_tokens": 9,
            "temperature": 0,
            "ignore_eos": True,
            "return_output_ids": True,
        },
        "custom_output_params": {"position": [ALL]},
    }
    whole = httpx.post(ahead.url + "/generate", json=body, timeout=120).json()
    out = whole["output_ids"]
    positions = list(range(19, 28))
    assert len(out) == 9 and whole["custom_output_positions"] == positions
    assert_rows(ref, ids + out, positions, whole["custom_output"])
    chunks = client_of(ahead).completions.create(  # (not gated: a gate would stall the
        model=MODEL,  # step in flight, which waits on its successor's launch)
        prompt=ids,
        max_tokens=9,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "custom_output_params": {"position": [ALL]}},
    )
    chunks = list(chunks)
    pos, rows = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            extra = extra_of(choice)
            assert len(extra.get("custom_output", [])) == len(
                extra.get("custom_output_positions", [])
            )
            pos += extra.get("custom_output_positions", [])
            rows += extra.get("custom_output", [])
    assert pos == positions
    np.testing.assert_allclose(rows, whole["custom_output"], rtol=1e-5, atol=1e-5)

    def steps_ahead() -> float:
        metrics = httpx.get(ahead.url + "/metrics", timeout=30).text
        line = next(x for x in metrics.splitlines() if x.startswith("tapserve_engine_steps_ahead"))
        return float(line.split()[-1])

    assert wait_for(lambda: steps_ahead() > 0, 10)
