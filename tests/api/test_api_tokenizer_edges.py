"""A checkpoint whose model vocabulary is padded past its tokenizer's (as real Qwen3
checkpoints are) and whose tokenizer adds a BOS (a post-processor, as Llama's):

- ids past the tokenizer's entries can be sampled; completions logprobs name each
  `token_id:N` (as vLLM's return_tokens_as_token_ids) instead of one empty string they
  overwrote each other under, and /detokenize takes the ids the model produced;
- /tokenize honours add_special_tokens for messages too (default off there, as vLLM)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.api import LiveServer
from tests.helpers.checkpoints import make_tiny_checkpoint

TOKENIZER_VOCAB, MODEL_VOCAB = 1024, 1100
BOS = 1021  # the demo tokenizer's <|endoftext|>


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_tiny_checkpoint(
        tmp_path_factory.mktemp("padded") / "m", "qwen3", tokenizer=True, vocab_size=MODEL_VOCAB
    )
    path = ckpt / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [BOS], "tokens": ["<|endoftext|>"]}
        },
    }
    path.write_text(json.dumps(spec))
    s = LiveServer("--model", str(ckpt), "--served-model-name", "m", "--custom-module", "none")
    yield s
    assert s.stop() == 0, s.log_tail()


def test_padded_ids_are_named_apart_and_detokenize(server):
    padded = [1050, 1060, 1070]
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={
            "model": "m",
            "prompt": "Hello",
            "max_tokens": 2,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 3,
            "logit_bias": {str(t): 100 for t in padded},
        },
    )
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    assert all(t in {f"token_id:{i}" for i in padded} for t in logprobs["tokens"])
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        assert token in top and len(top) >= 3  # (raw logprobs: before the bias)
    answer = httpx.post(server.url + "/detokenize", json={"tokens": [72, *padded]}, timeout=30)
    assert answer.status_code == 200, answer.text
    beyond = httpx.post(server.url + "/detokenize", json={"tokens": [MODEL_VOCAB]}, timeout=30)
    assert beyond.status_code == 400 and f"[0, {MODEL_VOCAB})" in beyond.json()["message"]
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={  # a prompt holding them
            "model": "m",
            "prompt": [72, *padded],
            "max_tokens": 1,
            "temperature": 0,
        },
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4, r.text


def test_tokenize_honours_add_special_tokens_for_messages(server):
    def tokens(**body) -> list[int]:
        r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    messages = [{"role": "user", "content": "hi"}]
    assert tokens(prompt="hi")[0] == BOS and tokens(prompt="hi", add_special_tokens=False)[0] != BOS
    assert tokens(messages=messages)[0] != BOS  # the template writes what it needs
    assert tokens(messages=messages, add_special_tokens=True) == [BOS, *tokens(messages=messages)]
