"""Live-server tests of API keys, 606 errors (before and after the stream opened) and the
queue limit (shared server of tests/helpers/api.py: an API key, CrashyHead,
`--max-queued-requests 0` with 256 running sequences)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tests.helpers import wait_for  # noqa: E402
from tests.helpers.api import API_KEY, metric, sse_events  # noqa: E402

pytest_plugins = ["tests.helpers.api"]
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture
def model(client) -> str:
    return client.models.list().data[0].id


def test_api_key_required_except_health(server, model):
    assert httpx.get(server.url + "/health").status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=model, prompt="x", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    for path in ("/generate", "/tokenize", "/custom_output"):
        r = httpx.post(server.url + path, json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error_code"] == 401
    assert httpx.get(server.url + "/metrics").status_code == 401
    ok = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_right_key_works(client, model):
    r = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True}
    )  # sampled: EOS could end it
    assert r.usage.completion_tokens == 2


def test_606_before_first_token_is_plain_http(client, model, http):
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=2,
                stream=stream,
                extra_body={"custom_output_params": {"crash": "select"}},
            )
        assert e.value.status_code == 500
        assert e.value.body["code"] == "606_EXECUTION_EXCEPTION"
    r = http.post("/generate", json={"prompt": PROMPT, "custom_output_params": {"crash": "select"}})
    assert r.status_code == 500 and r.json()["error_code"] == 606
    assert r.json()["error_code_str"] == "606_EXECUTION_EXCEPTION"
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=1).choices


def test_606_after_accept_is_last_sse_event(client, model, http):
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 4,
        "stream": True,
        "custom_output_params": {"crash": "forward"},
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    last = json.loads(events[-1])
    assert last["error"]["code"] == "606_EXECUTION_EXCEPTION"
    assert "head exploded" in last["error"]["message"]
    with pytest.raises(openai.InternalServerError) as e:  # the same, not streaming
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=4,
            extra_body={"custom_output_params": {"crash": "forward"}},
        )
    assert e.value.body["code"] == "606_EXECUTION_EXCEPTION"
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=3,  # recovery
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 3 and r.model_extra["extra_outputs"]["custom_output"]


async def _fill_and_probe(server, model: str, slots: int) -> tuple[list[int], int, int]:
    """Hold `slots` long streams open, then send one more request and one native request."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    limits = httpx.Limits(max_connections=slots + 10)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=120, limits=limits
    ) as c:
        opened = asyncio.Event()
        started: list[int] = []

        async def hold() -> None:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                started.append(r.status_code)
                if len(started) == slots:
                    opened.set()
                await asyncio.sleep(3600)  # cancelled below: the client disconnects

        holders = [asyncio.create_task(hold()) for _ in range(slots)]
        await asyncio.wait_for(opened.wait(), 120)
        extra = await c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 1})
        native = await c.post("/generate", json={"prompt": "x"})
        for t in holders:
            t.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        return started, extra.status_code, native.status_code


def test_503_when_queue_full(server, model, client):
    # 256 running sequences (launch.py's default --max-num-seqs) + 0 queued
    started, extra, native = asyncio.run(_fill_and_probe(server, model, 256))
    assert started == [200] * 256
    assert extra == 503 and native == 503
    assert wait_for(lambda: metric(server, "tapserve_api_requests_in_flight") == 0, 60)
    assert wait_for(lambda: metric(server, "tapserve_kv_blocks_used") == 0, 60)
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=1).choices


async def _score_batches(server, batches: int, prompts: int) -> list[httpx.Response]:
    body = {"prompts": [f"prompt {i} of a batch" for i in range(prompts)]}
    limits = httpx.Limits(max_connections=batches + 5)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=120, limits=limits
    ) as c:
        return await asyncio.gather(*[c.post("/custom_output", json=body) for _ in range(batches)])


def test_a_custom_output_batch_is_admitted_whole_or_not_at_all(server):
    """40 batches of 16 prompts against room for 256: each is refused at once (503) or
    scored whole. Its prompts were submitted one by one after awaits, so a batch admitted
    at its start could lose its room to a concurrent one and answer 200 with 503 entries."""
    answers = asyncio.run(_score_batches(server, 40, 16))
    scored = [r for r in answers if r.status_code == 200]
    assert {r.status_code for r in answers} <= {200, 503} and scored
    for r in scored:
        outputs = r.json()["outputs"]
        assert len(outputs) == 16 and all("custom_output" in o for o in outputs), [
            o for o in outputs if "custom_output" not in o
        ][:1]
    assert wait_for(lambda: metric(server, "tapserve_api_requests_in_flight") == 0, 60)


def test_prompt_tokens_count_accepted_prompts_only(server, http):
    """A prompt the engine refuses (its selector's position is out of range: 605) is never
    prefilled and does not count in tapserve_prompt_tokens_total."""
    before = metric(server, "tapserve_prompt_tokens_total")
    r = http.post(
        "/generate",
        json={
            "input_ids": [5] * 100,
            "custom_output_params": {"position": 500},
            "generate_config": {"max_new_tokens": 1},
        },
    )
    assert r.status_code == 400 and r.json()["error_code"] == 605, r.text
    assert metric(server, "tapserve_prompt_tokens_total") == before
    r = http.post(
        "/generate", json={"input_ids": [5] * 10, "generate_config": {"max_new_tokens": 1}}
    )
    assert r.status_code == 200
    assert metric(server, "tapserve_prompt_tokens_total") == before + 10


async def _health_during_a_huge_tokenize(server) -> tuple[float, list[float]]:
    """How long a ~6 MB /tokenize took, and how long each /health probe sent while it ran
    waited for its answer."""
    text = "The quick brown fox jumps over the lazy dog. " * 135000
    waits: list[float] = []
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:

        async def tokenize() -> float:
            start = time.monotonic()
            r = await c.post("/tokenize", json={"prompt": text})
            assert r.status_code == 200 and r.json()["count"] > 500_000
            return time.monotonic() - start

        async def health() -> None:
            await asyncio.sleep(0.5)  # the tokenize is under way (it takes seconds)
            for _ in range(3):
                start = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                waits.append(time.monotonic() - start)

        took, _ = await asyncio.gather(tokenize(), health())
    return took, waits


def test_a_huge_prompt_does_not_stall_other_clients(server):
    """A large body is tokenized in a worker thread, through the tokenizer's call that
    releases the GIL: /health (and every stream) keeps answering meanwhile. Before, each
    probe waited for the rest of the tokenize (seconds)."""
    took, waits = asyncio.run(_health_during_a_huge_tokenize(server))
    assert took > 1.0, "the tokenize must take long enough to tell"
    assert max(waits) < took / 4, (took, waits)
