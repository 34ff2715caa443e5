"""Unit tests of the API process's pieces that need no server: the ApiConfig command line,
custom-output JSON/base64 encoding, the incremental detokenizer and stop strings, the wire
round trip, and the error envelopes (tests/api/test_api_process_imports.py: what a running
API process imports)."""

from __future__ import annotations

import base64
import os
import stat

import numpy as np
import pytest
import torch

from tapserve.api import wire
from tapserve.api.config import ApiConfig
from tapserve.api.detokenizer import IncrementalDetokenizer, StopChecker
from tapserve.api.errors import ApiError
from tapserve.api.values import encode_value, finite_logprob


def test_api_config_argv_roundtrip(tmp_path):
    ipc = tmp_path / "ipc"
    cfg = ApiConfig(
        ipc_dir=str(ipc),
        tokenizer="/tok",
        served_model_name="m",
        port=1234,
        api_key="s3cret",
        max_num_seqs=8,
        max_queued_requests=3,
        log_requests=True,
        chat_template="/t.jinja",
        max_tokens=100,
        parent_pid=42,
    )
    argv = cfg.to_argv()
    assert "s3cret" not in " ".join(argv)  # the key travels in a 0600 file, not in argv
    key_file = argv[argv.index("--api-key-file") + 1]
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert ApiConfig.from_argv(argv) == cfg
    assert cfg.max_in_flight == 11
    plain = ApiConfig(ipc_dir="/x", tokenizer="/t")
    assert ApiConfig.from_argv(plain.to_argv()) == plain
    dashes = ApiConfig(
        ipc_dir="/x",
        tokenizer="/t",
        served_model_name="-m",
        chat_template="--x",
        eos_token_ids=(-1,),
    )  # (a reviewer: exit 2)
    assert ApiConfig.from_argv(dashes.to_argv()) == dashes
    with pytest.raises(ValueError):
        ApiConfig(ipc_dir="/x", tokenizer="/t", max_n=0)


def _wire_value(t: torch.Tensor) -> dict:
    carrier = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "data": carrier.numpy().tobytes(),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_values_widen_exactly(dtype):
    t = torch.tensor([[1.0 / 3, -2.5e-3, 65504.0 if dtype == torch.float16 else 1e30]]).to(dtype)
    assert encode_value(_wire_value(t)) == t.double().tolist()
    assert encode_value(_wire_value(t[0, :1].reshape(1))) == [t[0, 0].double().item()]


def test_int32_and_non_finite_values():
    ints = torch.tensor([[1, -7, 2**31 - 1]], dtype=torch.int32)
    assert encode_value(_wire_value(ints)) == [[1, -7, 2**31 - 1]]
    special = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.5]])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert encode_value(_wire_value(special.to(dtype))) == [
            ["NaN", "Infinity", "-Infinity", 0.5]
        ]
    assert finite_logprob(-float("inf")) == -9999.0 and finite_logprob(-1.5) == -1.5


def test_base64_value_is_raw_bytes():
    t = torch.tensor([[1.5, float("nan")]], dtype=torch.bfloat16)
    value = _wire_value(t)
    b64 = encode_value(value, "base64")
    assert b64["dtype"] == "bfloat16" and b64["shape"] == [1, 2]
    assert base64.b64decode(b64["data"]) == value["data"]


class _Tok:
    """The demo tokenizer through api.tokenizer (no transformers)."""

    def __init__(self):
        from tapserve.api.tokenizer import TextTokenizer
        from tapserve.model.demo import ensure_demo_checkpoint

        self.t = TextTokenizer.from_dir(ensure_demo_checkpoint())


@pytest.fixture(scope="module")
def tok():
    return _Tok().t


def _stream(tok, ids, stop=None, include=False, prompt=()):
    d = IncrementalDetokenizer(tok, list(prompt), True, StopChecker(stop or [], include))
    pieces = []
    for i in ids:
        d.add_tokens([i])
        pieces.append(d.take_delta())
    d.finish()
    pieces.append(d.take_delta(final=True))
    return pieces, d


def test_detokenizer_is_utf8_safe(tok):
    text = "Hello café naïve 😀 日本語 world"
    ids = tok.encode(text)
    pieces, _ = _stream(tok, ids, prompt=tok.encode("Say:"))
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_text_equals_a_full_decode_whatever_the_bytes(tok):
    """Random outputs mixing characters of 1-4 bytes with runs of stray bytes (invalid
    UTF-8): the streamed text equals a full decode. A valid character after 7 or more stray
    bytes was flushed as U+FFFD when the wait gave up, then lost (an outside fuzzer's find:
    7 x 0xA7 then the two bytes of U+061C)."""
    import random

    byte_ids = [
        i
        for i in range(tok.vocab_size)
        if len(tok.token_bytes(i)) == 1 and i not in tok.special_ids
    ]
    stray = [i for i in byte_ids if 0x80 <= tok.token_bytes(i)[0] < 0xC0]  # continuations
    words = ["a", " é", "日本", "😀", "\u061c", " word", "ü"]
    prompt = tok.encode("Say:")
    rng = random.Random(7)
    cases = [[stray[0]] * 7 + [i for i in byte_ids if tok.token_bytes(i) in (b"\xd8", b"\x9c")]]
    for _ in range(300):
        ids = []
        for _ in range(rng.randint(1, 12)):
            ids += (
                [rng.choice(stray)] * rng.randint(1, 12)
                if rng.random() < 0.4
                else [
                    b
                    for ch in rng.choice(words).encode()
                    for b in byte_ids
                    if tok.token_bytes(b) == bytes([ch])
                ]
            )
        cases.append(ids)
    for ids in cases:
        pieces, _ = _stream(tok, ids, prompt=prompt)
        want = tok.decode(prompt + ids, False)[len(tok.decode(prompt, False)) :]
        assert "".join(pieces) == want, ids


def _sentencepiece_tokenizer():
    """A SentencePiece byte-fallback vocabulary with Llama 2's decoder chain (byte runs
    decode as a whole; U+2581 marks a word's space), and its vocab."""
    from tokenizers import Tokenizer, decoders, models

    from tapserve.api.tokenizer import TextTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in ("\u2581hello", "\u2581world", "\u2581caf", "b", "a"):
        vocab[word] = len(vocab)
    sp = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    sp.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return TextTokenizer(sp, {"eos_token": "</s>"}, None), vocab


def test_detokenizer_keeps_text_after_stray_bytes_with_byte_fallback():
    """With byte-fallback runs, the text after seven stray bytes, a split character and
    emoji comes out as a full decode shows it. (The first version of the give-up hold-back
    cut such a run and lost everything after it; a review's find.)"""
    tok, vocab = _sentencepiece_tokenizer()
    emoji = [3 + b for b in "😀".encode()]
    ids = [
        vocab["\u2581hello"],
        *[3 + 0x8C] * 7,
        3 + 0xD8,
        3 + 0x9C,
        *emoji,
        *emoji,
        vocab["b"],
        *[3 + b for b in "é".encode()],
        *emoji,
        vocab["a"],
    ]
    prompt = [vocab["\u2581hello"], vocab["\u2581world"]]
    pieces, _ = _stream(tok, ids, prompt=prompt)
    assert "".join(pieces) == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert "".join(pieces).endswith("b\xe9\U0001f600a")


def test_detokenizer_window_starts_on_a_character_after_a_byte_fallback_prompt():
    """A prompt ending in a SentencePiece byte run longer than the window (日本 is six
    <0xNN> tokens): the output's text is what a full decode gives, streamed or not, and the
    stop-string cut on rank 0 agrees. The window used to start inside the run, which made
    the whole run invalid UTF-8: every output byte after it came out as U+FFFD (an outside
    tester's find)."""
    from tapserve.api.detokenizer import PROMPT_CONTEXT, prompt_context

    sp, vocab = _sentencepiece_tokenizer()
    cjk = [3 + b for b in "日本".encode()]
    for prompt in ([vocab["\u2581hello"], *cjk], cjk, [vocab["a"], *cjk, *cjk]):
        assert len(prompt) > PROMPT_CONTEXT
        window = prompt_context(sp, prompt)
        assert sp.text_bytes(window[0])[0] < 0x80 or sp.text_bytes(window[0])[0] >= 0xC0
        ids = [3 + ord("I"), 3 + ord("I"), vocab["a"], *[3 + b for b in "é".encode()]]
        pieces, d = _stream(sp, ids, prompt=prompt)
        assert "".join(pieces) == sp.decode(prompt + ids)[len(sp.decode(prompt)) :] == "IIaé"
        _, cut = _stream(sp, ids, stop=["Ia"], prompt=prompt)
        assert cut.text == "I" and cut.stopped


def test_text_offsets_of_sentencepiece_tokens_and_open_prompts(tok):
    """text_offset from token bytes where a SentencePiece vocabulary spells them (a <0xNN>
    entry is that byte, U+2581 a space), names for partial tokens (bytes:\\xNN), and a
    prompt that ends inside a character whose last bytes the output brings (they are the
    prompt's text, not counted). Review finds: offsets drifted, byte tokens shared a name."""
    from tapserve.api.detokenizer import IncrementalDetokenizer, TextOffsets, open_character_bytes

    sp, vocab = _sentencepiece_tokenizer()
    prompt = [vocab["\u2581hello"]]
    ids = [
        vocab["\u2581world"],
        vocab["\u2581caf"],
        3 + 0xC3,
        3 + 0xA9,
        vocab["b"],
        vocab["\u2581world"],
    ]
    names = [sp.legacy_token_str(t) for t in ids]
    assert names == [" world", " caf", "bytes:\\xc3", "bytes:\\xa9", "b", " world"]
    counter = TextOffsets(open_character_bytes([sp.text_bytes(t) for t in prompt]))
    offsets = [counter.add(sp.text_bytes(t)) for t in ids]
    text = sp.decode(prompt + ids)[len(sp.decode(prompt)) :]
    assert offsets == [0, 6, 10, 10, 11, 12] and text == " world caféb world"
    assert all(text.startswith(n, o) for n, o in zip(names, offsets) if not n.startswith("bytes:"))
    # byte-level BPE, a prompt ending with two of the three bytes of 中
    zhong = tok.encode("中")
    prompt, out = tok.encode("Say:") + zhong[:2], [zhong[2]] + tok.encode("ab")
    counter = TextOffsets(open_character_bytes([tok.token_bytes(t) for t in prompt]))
    offsets = [counter.add(tok.token_bytes(t)) for t in out]
    d = IncrementalDetokenizer(tok, prompt, True)
    d.add_tokens(out)
    d.finish()
    assert d.text == "ab" and offsets[1:] == [0, 1][: len(out) - 1]
    # ... and an output that does not finish it: the prompt's U+FFFD is the prompt's text
    counter = TextOffsets(open_character_bytes([tok.token_bytes(t) for t in prompt]))
    assert [counter.add(tok.token_bytes(t)) for t in tok.encode("ab cd")][0] == 0


def test_text_offsets_count_characters_as_a_lossy_utf8_decode():
    """TextOffsets over random bytes split into random tokens: the offsets never fall, a
    token that begins with an ASCII character starts where a UTF-8 decode with U+FFFD (one
    per maximal bad run) puts it, and the count agrees with Python's decode."""
    import random

    from tapserve.api.detokenizer import TextOffsets

    rng = random.Random(3)
    pool = b"ab\xc3\xa9\xe4\xb8\xad\xed\x9f\xbf\xa0\xf0\x9f\x98\x80\xf4\x8f\x90\xe0\xff"
    for _ in range(3000):
        data = bytes(rng.choice(pool) for _ in range(rng.randint(1, 16)))
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, len(data) - 1)))
        tokens = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)])]
        counter, offsets = TextOffsets(), []
        for token in tokens:
            offsets.append(counter.add(token))
        assert offsets == sorted(offsets)
        text = data.decode("utf-8", "replace")
        for token, offset in zip(tokens, offsets):
            if token[0] < 0x80:  # an ASCII start: the character is exactly there
                assert text[offset] == chr(token[0]), (data, tokens, offsets)
        assert counter.add(b"a") == len(text)


def test_detokenizer_drops_held_bytes_of_a_left_out_token(tok):
    """A stop token id whose text is left out ends the sequence: the bytes held for the
    character it would have completed are dropped, not flushed as U+FFFD."""
    ids = tok.encode("ok 日")
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tok.decode(ids[:i]))
    d = IncrementalDetokenizer(tok, [], True, StopChecker())
    d.add_tokens(ids[:cut])  # the last of them holds a partial character
    d.drop_held()
    d.finish()
    assert d.take_delta(final=True) == tok.decode(ids[:cut]).rstrip("\ufffd") == "ok "
    flushed = IncrementalDetokenizer(tok, [], True, StopChecker())
    flushed.add_tokens(ids[:cut])
    flushed.finish()
    assert flushed.take_delta(final=True).endswith("\ufffd")  # what finish() alone does


PIECES = [b"\xe4\xb8", b"\x96\xe7\x95", b" \xe4"]  # entries a larger vocabulary has


@pytest.fixture(scope="module")
def pieces_tok(tmp_path_factory):
    """The demo tokenizer with PIECES as entries 2000.. (decoding needs no merges)."""
    import json
    import shutil

    from tapserve.api.tokenizer import _BYTE_OF_CHAR
    from tapserve.model.demo import ensure_demo_checkpoint

    folder = tmp_path_factory.mktemp("pieces")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_demo_checkpoint() / name, folder / name)
    spec = json.loads((folder / "tokenizer.json").read_text())
    char_of = {b: c for c, b in _BYTE_OF_CHAR.items()}
    for i, piece in enumerate(PIECES):
        spec["model"]["vocab"]["".join(char_of[b] for b in piece)] = 2000 + i
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    from tapserve.api.tokenizer import TextTokenizer

    return TextTokenizer.from_dir(folder)


@pytest.mark.parametrize(
    "tail,want",
    [
        ([b"\xc3", b"\xf7"], "ok\ufffd\ufffd"),
        ([b"\xf7", b"\xe6"], "ok\ufffd"),
        ([b"f", b"\xc3", b"\xf7"], "okf\ufffd\ufffd"),
        ([b"\xe6", b"\x97"], "ok"),
        ([b"f\xc3"], "okf"),  # a letter sharing a token with a lead byte
        ([b"\xe4\xb8", b"\x96\xe7\x95"], "ok\u4e16"),  # the last token completes one, opens one
        ([b" \xe4"], "ok "),
        ([b"\xe4", "<|im_start|>"], "ok"),  # a skipped special token after the lead byte
        ([b"\xe0", b"\x80"], "ok\ufffd\ufffd"),  # E0 80 is overlong: nothing could complete it
    ],
)
def test_detokenizer_drops_only_an_open_character_for_a_left_out_token(pieces_tok, tail, want):
    """Only the held bytes that begin a character the left-out token might have completed
    (one U+FFFD at the end) are dropped; held characters that are already final go out
    (U+FFFD for a byte that never begins a character, a letter or a completed character
    sharing a token with a lead byte). All the held text was dropped (an outside fuzzer's
    find: "f\\xc3" then 0xF7 lost the "f")."""
    tok = pieces_tok
    ids_of = {
        tok.token_bytes(i): i
        for i in [*range(tok.vocab_size), 2000, 2001, 2002]
        if i not in tok.special_ids
    }
    d = IncrementalDetokenizer(tok, [], True, StopChecker())
    d.add_tokens(
        tok.encode("ok")
        + [
            ids_of[piece] if isinstance(piece, bytes) else tok.tokenizer.token_to_id(piece)
            for piece in tail
        ]
    )
    d.drop_held()
    d.finish()
    assert d.take_delta(final=True) == want


@pytest.mark.parametrize(
    "pieces",
    [
        [b"\xe4", "<|im_start|>", b"\xb8", b"\x96"],  # a skipped special token at the give-up point
        [b"\xe4\xb8", b"\x96\xe7\x95", b"\x8c"],  # one token completes a character, opens one
        [b"\xe4", *["<|im_end|>"] * 7, b"\xb8", b"\x96"],  # the first held token opens it
    ],
)
def test_detokenizer_gives_up_where_the_text_is_final(pieces_tok, pieces):
    """After 8 held tokens the detokenizer gives up waiting, keeping back the tokens of a
    character still open: measured by the bytes the text shows (a skipped special token
    shows none), and cut where the text before is final. Both cases flushed the open
    character as U+FFFD, and its completion was lost."""
    tok = pieces_tok
    ids_of = {
        tok.token_bytes(i): i
        for i in [*range(tok.vocab_size), 2000, 2001, 2002]
        if i not in tok.special_ids
    }
    strays = 6 if len(pieces) < 5 else 0
    ids = [ids_of[b"\x80"]] * strays + [
        ids_of[p] if isinstance(p, bytes) else tok.tokenizer.token_to_id(p) for p in pieces
    ]
    streamed, _ = _stream(tok, ids)
    assert "".join(streamed) == tok.decode(ids)
    assert tok.decode(ids).startswith("\ufffd" * strays + "\u4e16")


def test_detokenizer_stop_strings(tok):
    text = "one two three four five six"
    ids = tok.encode(text)
    pieces, d = _stream(tok, ids, stop=["four", "nothing"])
    assert "".join(pieces) == "one two three " and d.stopped
    assert all("f" not in p for p in pieces)  # the stop string's start was never sent
    _, kept = _stream(tok, ids, stop=["four"], include=True)
    assert kept.text == "one two three four"
    assert kept.num_tokens < len(ids)


def test_detokenizer_kept_tokens(tok):
    """The output tokens the kept text needs (rank 0 scores the last one, LAST_GENERATED):
    independent of how the stop string falls on token boundaries, checked by decoding."""
    text = "one two three four five six 😀 end"
    ids = tok.encode(text)
    for stop, include in [
        ("four", False),
        ("four", True),
        ("hree f", False),
        ("one", False),
        ("😀", False),
        ("😀 e", True),
        ("absent", False),
    ]:
        _, d = _stream(tok, ids, stop=[stop], include=include)
        k = d.kept_tokens
        if stop == "absent":
            assert not d.stopped and k == len(ids)
            continue
        assert d.stopped and tok.decode(ids[:k]).startswith(d.text), (stop, include, k)
        # and no fewer tokens would do (nothing kept: none)
        assert (k == 0) == (d.text == "") and (
            k == 0 or not tok.decode(ids[: k - 1]).startswith(d.text)
        )


def test_detokenizer_skip_special_tokens(tok):
    ids = tok.encode("hi<|im_end|>")
    _, d = _stream(tok, ids)
    assert d.text == "hi"
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    keep.add_tokens(ids)
    keep.finish()
    assert keep.text == "hi<|im_end|>"


def test_wire_roundtrip_and_envelopes():
    out = wire.Outputs(
        [
            wire.RequestOutput(
                "r1",
                sequences=[wire.SequenceOutput(0, [1, 2])],
                custom_output={"dtype": "float32", "shape": [1], "data": b"\0\0\x80?"},
            )
        ]
    )
    back = wire.decode(wire.encode(out))
    assert back.outputs[0].sequences[0].new_token_ids == [1, 2]
    assert encode_value(back.outputs[0].custom_output) == [1.0]
    e = ApiError(wire.INVALID_PARAMS, "bad", "temperature")
    assert e.status == 400 and e.openai_body()["error"]["code"] == "605_INVALID_PARAMS"
    assert ApiError(wire.EXECUTION_EXCEPTION, "x").status == 500
    assert ApiError(503, "busy").native_body() == {
        "error_code": 503,
        "error_code_str": "503_SERVICE_UNAVAILABLE",
        "message": "busy",
    }
    assert np.isfinite(finite_logprob(float("nan")))


def test_gate_auth_and_body_limit():
    import asyncio

    import httpx
    from fastapi.responses import JSONResponse

    from tapserve.api.metrics import ApiMetrics
    from tapserve.api.server import Gate

    async def echo(scope, receive, send):
        body = (await receive()).get("body", b"")
        await JSONResponse({"size": len(body)})(scope, receive, send)

    cfg = ApiConfig(ipc_dir="/x", tokenizer="/t", api_key="k", max_body_bytes=1024)
    app = Gate(echo, cfg, ApiMetrics(lambda: wire.EngineStats()))

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            ok = await c.post(
                "/generate", content=b"x" * 1000, headers={"Authorization": "Bearer k"}
            )
            big = await c.post(
                "/v1/completions", content=b"x" * 2000, headers={"Authorization": "Bearer k"}
            )
            nokey = await c.post("/generate", content=b"{}")
            wrong = await c.post(
                "/v1/completions", content=b"{}", headers={"Authorization": "Bearer kk"}
            )
            health = await c.get("/health")
            return ok, big, nokey, wrong, health

    ok, big, nokey, wrong, health = asyncio.run(main())
    assert ok.json() == {"size": 1000}
    assert big.status_code == 413 and big.json()["error"]["code"] == "413_REQUEST_TOO_LARGE"
    assert nokey.status_code == 401 and nokey.json()["error_code"] == 401
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert health.status_code == 200


def test_gate_takes_a_key_beyond_ascii_as_the_client_sends_it(tmp_path):
    """curl sends a header's bytes as typed (UTF-8); the key was compared with the header
    decoded as latin-1 and encoded again as UTF-8, so a key with "é" never matched."""
    import asyncio

    import httpx
    from fastapi.responses import JSONResponse

    from tapserve.api.metrics import ApiMetrics
    from tapserve.api.server import Gate

    async def ok(scope, receive, send):
        await JSONResponse({})(scope, receive, send)

    cfg = ApiConfig(ipc_dir="/x", tokenizer="/t", api_key="sekret-ké y")
    app = Gate(ok, cfg, ApiMetrics(lambda: wire.EngineStats()))

    async def main(key: bytes):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/generate", headers=[(b"Authorization", b"Bearer " + key)])
            return r.status_code

    assert asyncio.run(main("sekret-ké y".encode())) == 200
    # through the API process's key file: a key ending in a no-break space keeps it
    nbsp = ApiConfig.from_argv(
        ApiConfig(ipc_dir=str(tmp_path), tokenizer="/t", api_key="k\u00a0").to_argv()
    )
    assert nbsp.api_key == "k\u00a0"
    assert asyncio.run(main("sekret-ké y".encode("latin-1"))) == 401
    assert asyncio.run(main(b"sekret-k y")) == 401


def test_an_unexpected_exception_answers_in_the_envelope():
    """A bug of ours in a handler is a 500 in the JSON envelope of its path, not Starlette's
    plain-text "Internal Server Error"."""
    import httpx
    from fastapi import FastAPI

    from tapserve.api.errors import install_handlers

    app = FastAPI()
    install_handlers(app)

    @app.post("/v1/completions")
    @app.post("/generate")
    async def broken() -> None:
        raise OverflowError("Range too big")

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/completions"), await c.post("/generate")

    import asyncio

    openai_answer, native_answer = asyncio.run(main())
    assert openai_answer.status_code == native_answer.status_code == 500
    assert openai_answer.json()["error"]["code"] == "500_INTERNAL_ERROR"
    assert "OverflowError" in openai_answer.json()["error"]["message"]
    assert native_answer.json()["error_code"] == 500


def test_validation_error_names_the_client_field_not_the_union_member():
    from fastapi.exceptions import RequestValidationError

    from tapserve.api.errors import validation_error

    for loc, name in [
        (("body", "stop", "str"), "stop"),
        (("body", "stop", "list[str]", 0), "stop.0"),
        (("body", "messages", 0, "content"), "messages.0.content"),
    ]:
        err = validation_error(
            RequestValidationError(
                [{"type": "string_type", "loc": loc, "msg": "Input should be a valid string"}]
            )
        )
        assert err.param == name and f"'{name}'" in err.message
    err = validation_error(
        RequestValidationError(  # an unknown field named by a lone surrogate
            [{"type": "string_unicode", "loc": (), "msg": "Input should be a valid string"}]
        )
    )
    assert "not valid Unicode" in err.message
