"""Hostile input against a live server: schemathesis cases generated from the app's own OpenAPI
schema (every operation, OpenAI and native), then hand-written malformed JSON, invalid UTF-8,
huge bodies, huge n / max_tokens, deep nesting, wrong types. Never a 5xx other than a
documented 606 (HTTP 500 with code 606), never a crash, never a hang (every answer within its
timeout, the server healthy afterwards).

The default run keeps to FUZZ_EXAMPLES cases per operation (< 60 s); the slow-marked
`test_fuzz_big` runs FUZZ_BIG_EXAMPLES per operation. Case counts are printed (`-s`) and
recorded in docs/reliability.md."""

from __future__ import annotations

import json
import os

import httpx
import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tests.helpers.api import LiveServer  # noqa: E402

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

KEY = "fuzz-key"
FUZZ_EXAMPLES = int(os.environ.get("TAPSERVE_FUZZ_EXAMPLES", "10"))
FUZZ_BIG_EXAMPLES = int(os.environ.get("TAPSERVE_FUZZ_BIG_EXAMPLES", "400"))
TIMEOUT = 30.0
COUNTS: dict[str, int] = {}


def _openapi() -> dict:
    from tests.reliability.test_security_server import app_openapi

    return app_openapi()


SCHEMA = schemathesis.openapi.from_dict(_openapi())


@pytest.fixture(scope="module")
def server():
    # a short context bounds the work any one fuzzed request can ask for (n x max_tokens)
    s = LiveServer("--max-model-len", "96", api_key=KEY)
    yield s
    print(f"\nfuzz cases per operation: {COUNTS}; total {sum(COUNTS.values())}")
    assert s.proc.poll() is None, s.log_tail()
    assert s.stop() == 0, s.log_tail()


def assert_acceptable(status: int, body: bytes, what: str) -> None:
    if status < 500:
        return
    if status == 500:
        try:
            data = json.loads(body)
        except ValueError:
            data = {}
        code = data.get("error_code") or (data.get("error") or {}).get("code")
        if code in (606, "606_EXECUTION_EXCEPTION"):
            return
    raise AssertionError(f"{what}: HTTP {status} {body[:300]!r}")


def _run_case(server: LiveServer, case, name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1
    headers = {**(case.headers or {}), "Authorization": f"Bearer {KEY}"}
    try:
        response = case.call(base_url=server.url, headers=headers, timeout=TIMEOUT)
    except Exception as e:  # a hang (timeout) or a dropped connection
        raise AssertionError(f"{case.method} {case.path}: {type(e).__name__}: {e}") from e
    assert_acceptable(
        response.status_code, response.content, f"{case.method} {case.path} {str(case.body)[:300]}"
    )
    assert server.proc.poll() is None, server.log_tail()


@SCHEMA.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_fuzz_from_openapi(case, server):
    _run_case(server, case, f"{case.method} {case.path}")


@pytest.mark.slow
@SCHEMA.parametrize()
@settings(max_examples=FUZZ_BIG_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_big(case, server):
    _run_case(server, case, f"big {case.method} {case.path}")


# ---- hand-written hostile bodies ------------------------------------------------------------
GEN_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",
    "/custom_output",
    "/tokenize",
    "/detokenize",
)


def _deep(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


RAW_BODIES = {
    "empty": b"",
    "not json": b"hello",
    "truncated": b'{"prompt": "abc"',
    "trailing garbage": b'{"prompt": "abc"} xyz',
    "invalid utf-8": b'{"prompt": "\xff\xfe\xc3\x28"}',
    "bom": b'\xef\xbb\xbf{"prompt": "x"}',
    "lone surrogate": b'{"prompt": "\\ud800 x", "messages": [{"role": "user", "content": "\\udfff"}]}',
    "nul bytes": b'{"prompt": "a\\u0000b", "model": "tapserve-demo", "max_tokens": 1}',
    "NaN": b'{"prompt": "x", "temperature": NaN, "max_tokens": 1}',
    "Infinity": b'{"prompt": "x", "top_p": Infinity, "max_tokens": 1}',
    "huge int": b'{"prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}",
    "huge float": b'{"prompt": "x", "temperature": 1e400}',
    "deep nesting 100k": _deep(100_000),
    "deep nesting 2k": _deep(2_000),
    "array root": b"[1, 2, 3]",
    "string root": b'"prompt"',
    "null root": b"null",
    "duplicate keys": b'{"prompt": "x", "prompt": [1, 2], "max_tokens": 1, "max_tokens": 2}',
}

JSON_BODIES = {
    "huge n": {"model": "tapserve-demo", "prompt": "x", "n": 10**9},
    "huge max_tokens": {"model": "tapserve-demo", "prompt": "x", "max_tokens": 10**12},
    "negative max_tokens": {"model": "tapserve-demo", "prompt": "x", "max_tokens": -5},
    "huge logprobs": {"model": "tapserve-demo", "prompt": "x", "logprobs": 10**6},
    "huge top_k": {"model": "tapserve-demo", "prompt": "x", "top_k": 2**63, "max_tokens": 1},
    "huge seed": {"model": "tapserve-demo", "prompt": "x", "seed": 2**80, "max_tokens": 1},
    "negative seed": {"model": "tapserve-demo", "prompt": "x", "seed": -1, "max_tokens": 1},
    "huge token id": {"model": "tapserve-demo", "prompt": [2**40], "max_tokens": 1},
    "negative token id": {"model": "tapserve-demo", "prompt": [-1], "max_tokens": 1},
    "token ids as floats": {"model": "tapserve-demo", "prompt": [1.5, 2.0], "max_tokens": 1},
    "many prompts": {"model": "tapserve-demo", "prompt": ["x"] * 5000, "max_tokens": 1},
    "wrong types": {
        "model": 5,
        "prompt": {"a": 1},
        "max_tokens": "many",
        "stream": "yes",
        "n": [1],
        "temperature": "hot",
        "stop": 7,
        "logit_bias": [1, 2],
    },
    "logit_bias keys": {
        "model": "tapserve-demo",
        "prompt": "x",
        "max_tokens": 1,
        "logit_bias": {"not a number": 1, "99999999": 100},
    },
    "stop list huge": {
        "model": "tapserve-demo",
        "prompt": "x",
        "max_tokens": 2,
        "stop": ["a" * 100_000] * 4,
    },
    "messages wrong": {"model": "tapserve-demo", "messages": [{"role": "wizard", "content": 5}]},
    "messages empty": {"model": "tapserve-demo", "messages": []},
    "custom params deep": {
        "model": "tapserve-demo",
        "prompt": "x",
        "max_tokens": 1,
        "custom_output_params": {"position": {"a": [[[[]]]]}},
    },
    "custom position huge": {
        "model": "tapserve-demo",
        "prompt": "x",
        "max_tokens": 1,
        "custom_output_params": {"position": 2**70},
    },
    "generate_config wrong": {
        "prompt": "x",
        "generate_config": {"max_new_tokens": "x", "num_beams": 10**6},
    },
    "beams huge": {"prompt": "x", "generate_config": {"num_beams": 16, "max_new_tokens": 10**9}},
    "detokenize huge ids": {"tokens": [2**62, -7, 10**30]},
    "prompt huge text": {"model": "tapserve-demo", "prompt": "word " * 200_000, "max_tokens": 1},
}


def test_hostile_bodies(server):
    h = {"Authorization": f"Bearer {KEY}"}
    cases, failures = 0, []
    with httpx.Client(base_url=server.url, headers=h, timeout=TIMEOUT) as c:
        for path in GEN_PATHS:
            for name, raw in RAW_BODIES.items():
                for ctype in ("application/json", "text/plain"):
                    r = c.post(path, content=raw, headers={"Content-Type": ctype})
                    assert_acceptable(r.status_code, r.content, f"{path} {name} {ctype}")
                    assert r.status_code in (400, 413, 415, 422) or r.status_code < 300, (
                        path,
                        name,
                    )
                    cases += 1
            for name, body in JSON_BODIES.items():
                for stream in (False, True):
                    r = c.post(
                        path, json={**body, "stream": stream} if "stream" not in body else body
                    )
                    try:
                        assert_acceptable(
                            r.status_code, r.content, f"{path} {name} stream={stream}"
                        )
                    except AssertionError as e:
                        failures.append(str(e))
                    cases += 1
        # a body over the 32 MiB limit: 413 (declared length or chunked); the server may also
        # reset the connection while the rest of the upload is still coming
        big = b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}'
        for content in (big, iter([big[i : i + 2**20] for i in range(0, len(big), 2**20)])):
            try:
                r = c.post(
                    "/v1/completions", content=content, headers={"Content-Type": "application/json"}
                )
                assert r.status_code == 413
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                pass
            cases += 1
        for method in ("PUT", "DELETE", "PATCH"):
            r = c.request(method, "/v1/completions")
            assert r.status_code == 405
            cases += 1
    print(f"\nhand-written hostile cases: {cases}")
    assert not failures, "\n".join(failures)
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(
        server.url + "/v1/completions",
        headers=h,
        timeout=TIMEOUT,
        json={"model": "tapserve-demo", "prompt": "fine", "max_tokens": 2},
    )
    assert r.status_code == 200


def test_lone_surrogates_are_605_where_text_is_tokenized(server):
    """A lone surrogate (the JSON escape "\\ud800") in text the server tokenizes is a 605
    (naming the field on the OpenAI API), on every endpoint, streamed or not; in a /custom_output batch only
    its own prompt fails. (`tokenizers` raised a TypeError: a plain-text HTTP 500.)"""
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bad_message = b'[{"role": "user", "content": "hi \\udfff"}]'
    cases = [
        ("/v1/completions", b'{"prompt": "\\ud800abc", "max_tokens": 2}', "prompt"),
        (
            "/v1/completions",
            b'{"prompt": ["ok", "abc\\udfff"], "max_tokens": 2, "stream": true}',
            "prompt",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": ' + bad_message + b', "max_tokens": 2}',
            "messages",
        ),
        (
            "/generate",
            b'{"prompt": "\\ud800abc", "generate_config": {"max_new_tokens": 2}}',
            "prompt",
        ),
        ("/generate", b'{"prompt": "abc\\udfff", "stream": true}', "prompt"),
        ("/generate", b'{"messages": ' + bad_message + b"}", "messages"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/tokenize", b'{"messages": ' + bad_message + b"}", "messages"),
    ]
    with httpx.Client(base_url=server.url, headers=h, timeout=TIMEOUT) as c:
        for path, raw, param in cases:
            r = c.post(path, content=raw)
            assert r.status_code == 400, (path, raw, r.status_code, r.text)
            body = r.json()
            if path.startswith("/v1/"):
                assert body["error"]["param"] == param, body
                body = body["error"]
            else:
                assert body["error_code"] == 605, body
            assert "lone surrogate" in body["message"], (path, body)
        r = c.post("/custom_output", content=b'{"prompts": ["abc\\ud800", "fine"]}')
        assert r.status_code == 200, r.text
        bad, good = r.json()["outputs"]
        assert bad["error_code"] == 605 and "lone surrogate" in bad["message"], bad
        assert "custom_output" in good and good["input_len"] > 0, good
        r = c.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00 fine", "max_tokens": 2}')
        assert r.status_code == 200, r.text  # a surrogate pair is a character, not an error


def test_a_lone_surrogate_in_the_model_name_is_a_404_not_a_500(server):
    """The 404 quoted the name, and its JSON body could not be encoded: a plain 500. Error
    messages now write a lone surrogate as its escape."""
    HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(
            server.url + path,
            timeout=60,
            headers=HEADERS,
            content=b'{"model": "\\ud800", "prompt": "hi", "messages": '
            b'[{"role": "user", "content": "hi"}], "max_tokens": 2}',
        )
        assert r.status_code in (400, 404), (path, r.status_code, r.text)
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        headers=HEADERS,
        content=b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}',
    )
    assert r.status_code == 404 and r.json()["error"]["message"].startswith(
        "the model '\\ud800'"
    ), r.text
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        headers=HEADERS,
        content=b'{"prompt": "hi", "max_tokens": 2, "stop": "\\udc00"}',
    )
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], r.text
