"""A model's generation_config.json gives the sampling defaults of fields a request leaves
out, as vLLM's --generation-config auto (an outside tester found them ignored: a Qwen3
deployment sampled at temperature 1 with no top-k or top-p). Live server on a copy of the
demo checkpoint whose generation config says top_k 1 (greedy whatever the temperature)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tapserve.api.config import ApiConfig  # noqa: E402
from tapserve.coordinator.generation_defaults import model_sampling_defaults  # noqa: E402
from tapserve.launch import sampling_defaults  # noqa: E402
from tapserve.model.demo import ensure_demo_checkpoint  # noqa: E402
from tests.helpers.api import ROOT, LiveServer  # noqa: E402

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
    config = ApiConfig.from_argv(
        ApiConfig(ipc_dir="/x", tokenizer="/t", sampling_defaults=entries).to_argv()
    )
    assert config.default_sampling == {"temperature": 0.9, "top_k": 1, "top_p": 0.95}
    (tmp_path / "generation_config.json").write_text('{"top_k": "many"}')
    with pytest.raises(SystemExit, match="top_k must be a number"):
        sampling_defaults(str(tmp_path), model_dir)


def _completion(server, **fields) -> str:
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"model": "m", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **fields},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_requests_without_sampling_fields_take_the_models_defaults(server):
    greedy = _completion(server, temperature=0)
    # top_k 1 from the generation config: every seed draws the greedy text
    assert {_completion(server, seed=s) for s in range(4)} == {greedy}
    r = httpx.post(
        server.url + "/generate",
        timeout=60,
        json={
            "prompt": PROMPT,
            "generate_config": {
                "max_new_tokens": 12,
                "ignore_eos": True,
                "do_sample": True,
                "seed": 5,
            },
        },
    )
    assert r.status_code == 200 and r.json()["response"] == greedy, r.text
    # a field the request gives wins over the default
    sampled = {_completion(server, seed=s, top_k=0, top_p=1.0) for s in range(4)}
    assert len(sampled) > 1


def test_every_default_fills_only_the_fields_a_request_leaves_out():
    """All five fields, OpenAI and native (a null is left out; do_sample false is greedy)."""
    from types import SimpleNamespace

    from tapserve.api.native import GenerateConfig
    from tapserve.api.openai_schemas import CompletionRequest
    from tapserve.api.state import AppState

    config = ApiConfig(
        ipc_dir="/x",
        tokenizer="/t",
        sampling_defaults=(
            "temperature=0.6",
            "top_k=20",
            "top_p=0.95",
            "min_p=0.05",
            "repetition_penalty=1.1",
        ),
    )
    state = SimpleNamespace(config=config)

    def fields(kwargs: dict) -> tuple:
        p = AppState.sampling_params(state, **kwargs)
        return p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty

    defaults = (0.6, 20, 0.95, 0.05, 1.1)
    assert fields(CompletionRequest(prompt="x").sampling_kwargs(4)) == defaults
    own = dict(temperature=0.2, top_k=5, top_p=0.5, min_p=0.0, repetition_penalty=1.0)
    assert fields(CompletionRequest(prompt="x", **own).sampling_kwargs(4)) == tuple(own.values())
    native = GenerateConfig.model_validate
    assert fields(native({"temperature": None, "top_k": None}).sampling_kwargs(4)) == defaults
    assert fields(native({"do_sample": False}).sampling_kwargs(4)) == (0.0, *defaults[1:])
    assert fields(native({"top_p": 0.5}).sampling_kwargs(4)) == (0.6, 20, 0.5, 0.05, 1.1)


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"top_p": 0.0}', "top_p must be in (0, 1]"),
        ('{"repetition_penalty": NaN}', "repetition_penalty must be a finite number"),
        ('{"top_k": 1e30}', "top_k must fit in 64 bits"),
        ('{"temperature": "hot"}', "temperature must be a number"),
        ("[1]", "is not a JSON object"),
    ],
)
def test_a_bad_generation_config_fails_at_start_up(tmp_path, content, message):
    """Before the model loads, with its message (these passed and then failed every request,
    /custom_output scoring included)."""
    import subprocess
    import sys

    (tmp_path / "generation_config.json").write_text(content)
    proc = subprocess.run(
        [sys.executable, "launch.py", "--generation-config", str(tmp_path), "--port", "0"],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "serving on" not in proc.stderr
