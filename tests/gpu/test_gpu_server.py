"""A live server on CUDA (`launch.py --device cuda`, float32, CUDA-graph decode), driven over
HTTP as a client would drive it, against transformers on the same GPU: greedy token ids and
custom outputs (a linear head on the final-normalized hidden state of the selected token)
alone and in a crowd of concurrent requests, seeded samples alone and crowded, and a streamed
completion against the same one unstreamed. The CPU suites check the same over HTTP on CPU;
tests/gpu/test_gpu_engine.py checks the engine on CUDA without HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tests.helpers.api import LiveServer, sse_events, sse_json
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.custom import HEAD_B, HEAD_W, head_tensors, linear_head

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LENGTHS = (1, 7, 16, 17, 40, 90)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("gpu_server") / "qwen3",
        "qwen3",
        tokenizer=True,
        extra_tensors=head_tensors(),
    )


@pytest.fixture(scope="module")
def server(ckpt):
    # recompute: a repeated prompt reuses its cached blocks only up to the selected token,
    # which is computed again and scored (under omit it would get no value)
    live = LiveServer(
        "--model",
        str(ckpt),
        "--dtype",
        "float32",
        "--custom-output-reuse",
        "recompute",
        "--custom-module",
        "tests.helpers.custom:ProbeHead",
        device="cuda",
    )
    yield live
    assert live.stop() == 0, live.log_tail()


@pytest.fixture(scope="module")
def reference(ckpt):
    """transformers on the GPU, float32 with TF32 off: (greedy ids, head value) of a prompt."""
    from transformers import AutoModelForCausalLM

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).cuda().eval()
    weights = {k: v.cuda() for k, v in head_tensors().items()}

    @torch.no_grad()
    def run(ids: list[int], position: int) -> tuple[list[int], list[list[float]]]:
        x = torch.tensor([ids], device="cuda")
        hidden = model(x, output_hidden_states=True).hidden_states[-1][0, position]
        # (an explicit attention mask: else a prompt token equal to pad_token_id is masked)
        gen = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        head = linear_head(hidden[None], weights[HEAD_W], weights[HEAD_B])  # [1, 3], as served
        return gen[0, len(ids) :].tolist(), head.cpu().tolist()

    yield run
    torch.backends.cuda.matmul.allow_tf32 = old


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in LENGTHS]


def _generate_body(ids: list[int], position: int, **config) -> dict:
    return {
        "input_ids": ids,
        "custom_output_params": {"position": position},
        "generate_config": {
            "max_new_tokens": NEW_TOKENS,
            "ignore_eos": True,
            "return_output_ids": True,
            "return_aux_info": True,
            **config,
        },
    }


async def _post_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        answers = await asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
    for a in answers:
        assert a.status_code == 200, a.text
    return [a.json() for a in answers]


def test_greedy_and_custom_outputs_match_transformers_alone_and_crowded(server, reference):
    prompts = _prompts()
    positions = [len(p) // 2 for p in prompts]
    bodies = [_generate_body(p, pos, temperature=0) for p, pos in zip(prompts, positions)]
    alone = asyncio.run(_post_all(server.url, bodies[:1])) + [
        asyncio.run(_post_all(server.url, [b]))[0] for b in bodies[1:]
    ]
    crowded = asyncio.run(_post_all(server.url, bodies * 4))  # 24 at once, prefix-cache hits
    for i, (ids, position) in enumerate(zip(prompts, positions)):
        want_ids, want_head = reference(ids, position)
        assert alone[i]["output_ids"] == want_ids, (len(ids), alone[i]["output_ids"], want_ids)
        torch.testing.assert_close(
            torch.tensor(alone[i]["custom_output"]), torch.tensor(want_head), rtol=1e-4, atol=1e-4
        )
        for answer in crowded[i :: len(prompts)]:
            assert answer["output_ids"] == want_ids
            assert answer["aux_info"]["reuse_len"] <= position
            torch.testing.assert_close(
                torch.tensor(answer["custom_output"]), torch.tensor(want_head), rtol=1e-4, atol=1e-4
            )
    assert any(a["aux_info"]["reuse_len"] > 0 for a in crowded)  # the cache was used


def test_seeded_samples_do_not_depend_on_their_batch(server):
    prompts = _prompts()
    seeded = [
        _generate_body(p, 0, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i)
        for i, p in enumerate(prompts)
    ]
    crowd = [_generate_body(p, 0, temperature=1.0) for p in prompts] * 3
    alone = [asyncio.run(_post_all(server.url, [b]))[0]["output_ids"] for b in seeded]
    mixed = asyncio.run(_post_all(server.url, crowd + seeded + crowd))
    assert [m["output_ids"] for m in mixed[len(crowd) : len(crowd) + len(seeded)]] == alone
    assert len({tuple(a) for a in alone}) == len(alone)  # the seeds do differ


def test_a_streamed_completion_equals_the_unstreamed_one(server):
    body = {
        "prompt": "The weather today is",
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }
    with httpx.Client(base_url=server.url, timeout=120) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = sse_json(sse_events(r))
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    assert "".join(c["text"] for c in choices) == whole["text"]
    streamed = [t for c in choices if c.get("logprobs") for t in c["logprobs"]["token_logprobs"]]
    torch.testing.assert_close(
        torch.tensor(streamed), torch.tensor(whole["logprobs"]["token_logprobs"])
    )
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
