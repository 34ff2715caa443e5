"""A model's generation_config.json gives the sampling defaults of fields a request leaves
out, as vLLM's --generation-config auto (an outside tester found them ignored: a Qwen3
deployment sampled at temperature 1 with no top-k or top-p). Live server on a copy of the
demo checkpoint whose generation config says top_k 1 (greedy whatever the temperature)."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest

pytest.register_assert_rewrite("tests.api_helpers")
from tests.api_helpers import LiveServer  # noqa: E402

from api.config import ApiConfig  # noqa: E402
from coordinator.sampling_params import model_sampling_defaults  # noqa: E402
from launch import sampling_defaults  # noqa: E402
from model.demo import ensure_demo_checkpoint  # noqa: E402

PROMPT = "The weather today"
GENERATION = {"do_sample": True, "temperature": 0.9, "top_k": 1, "top_p": 0.95}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen-defaults") / "model"
    shutil.copytree(ensure_demo_checkpoint(), folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **GENERATION}))
    return folder


@pytest.fixture(scope="module")
def server(model_dir):
    s = LiveServer("--model", str(model_dir), "--served-model-name", "m")
    yield s
    assert s.stop() == 0, s.log_tail()


def test_defaults_are_read_and_passed_to_the_api(model_dir, tmp_path):
    assert model_sampling_defaults(model_dir) == {"temperature": 0.9, "top_k": 1, "top_p": 0.95}
    entries = sampling_defaults("auto", model_dir)
    assert sampling_defaults("vllm", model_dir) == ()
    config = ApiConfig.from_argv(ApiConfig(ipc_dir="/x", tokenizer="/t",
                                           sampling_defaults=entries).to_argv())
    assert config.default_sampling == {"temperature": 0.9, "top_k": 1, "top_p": 0.95}
    (tmp_path / "generation_config.json").write_text('{"top_k": "many"}')
    with pytest.raises(SystemExit, match="top_k must be a number"):
        sampling_defaults(str(tmp_path), model_dir)


def _completion(server, **fields) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": "m", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True,
                         **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_requests_without_sampling_fields_take_the_models_defaults(server):
    greedy = _completion(server, temperature=0)
    # top_k 1 from the generation config: every seed draws the greedy text
    assert {_completion(server, seed=s) for s in range(4)} == {greedy}
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": PROMPT, "generate_config": {"max_new_tokens": 12, "ignore_eos": True,
                                              "do_sample": True, "seed": 5}})
    assert r.status_code == 200 and r.json()["response"] == greedy, r.text
    # a field the request gives wins over the default
    sampled = {_completion(server, seed=s, top_k=0, top_p=1.0) for s in range(4)}
    assert len(sampled) > 1
