"""The deployment modules in examples/: the reward head (weights in the checkpoint) and the
classifier head (weights in <module_stem>.safetensors beside the module), loaded by file
path as `--custom-module` does; and the demo model's DemoHead."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.api.wire import INVALID_PARAMS
from tapserve.model.demo import ensure_demo_checkpoint
from tests.helpers.custom import assert_close, greedy, make_llm, prompt, run

torch.set_num_threads(1)
pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REWARD = EXAMPLES / "reward_head.py"
CLASSIFIER = EXAMPLES / "classifier_head.py"
pytest_plugins = ["tests.helpers.custom_fixtures"]  # ckpt, ref


def load_example(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_head_from_checkpoint(ckpt, ref) -> None:
    llm = make_llm(ckpt, custom_module=str(REWARD))
    a, b = prompt(20, 1), prompt(33, 2)
    r = run(
        llm,
        [
            ("last", a, greedy(max_new_tokens=2), None),
            ("pos", b, greedy(max_new_tokens=2), {"position": 5}),
            ("bad", a, greedy(), {"positon": 5}),
            ("oor", a, greedy(), {"position": len(a)}),
        ],
    )
    assert r.final("last").custom_output["shape"] == [1]
    assert_close(r.value("last"), ref.reward(a, len(a) - 1))
    assert_close(r.value("pos"), ref.reward(b, 5))
    assert r.errors["bad"].code == INVALID_PARAMS and "positon" in r.errors["bad"].message
    assert r.errors["oor"].code == INVALID_PARAMS


def test_classifier_head_weights_beside_the_module(ckpt, ref, tmp_path) -> None:
    # a copy of the module with its own weights file: the engine must read the one beside it
    module_path = tmp_path / "my_classifier.py"
    shutil.copyfile(CLASSIFIER, module_path)
    example = load_example(CLASSIFIER)
    example.write_weights(
        tmp_path / "my_classifier.safetensors", hidden_size=64, num_classes=5, seed=3
    )
    weights = example.make_weights(64, 5, seed=3)
    llm = make_llm(ckpt, custom_module=f"{module_path}:ClassifierHead")
    ids = prompt(26, 4)
    r = run(
        llm,
        [
            ("c", ids, SamplingParams(max_new_tokens=0), {"position": 12}),
            ("d", ids, greedy(max_new_tokens=2), None),
        ],
    )
    for rid, pos in (("c", 12), ("d", len(ids) - 1)):
        value = r.value(rid)
        assert r.final(rid).custom_output["shape"] == [1, 5] and value.dtype == torch.float32
        h = ref.final_hidden(ids)[pos : pos + 1]
        expected = torch.softmax(
            torch.nn.functional.linear(
                h, weights["classifier_head.weight"], weights["classifier_head.bias"]
            ),
            dim=-1,
        )
        assert_close(value, expected)
        torch.testing.assert_close(value.sum(-1), torch.ones(1))


def test_committed_classifier_weights_are_reproducible(tmp_path) -> None:
    example = load_example(CLASSIFIER)
    regenerated = example.write_weights(tmp_path / "w.safetensors", hidden_size=64)
    assert regenerated.read_bytes() == (EXAMPLES / "classifier_head.safetensors").read_bytes()


def test_examples_and_demo_head_on_the_demo_model(tmp_path_factory) -> None:
    demo = ensure_demo_checkpoint(tmp_path_factory.mktemp("cache") / "demo")
    outputs = {}
    for spec, width in (("tapserve.model.demo:DemoHead", 2), (str(CLASSIFIER), 4)):
        llm = make_llm(demo, custom_module=spec)
        result = llm.generate(
            ["The quick brown fox", "Once upon a time"],
            SamplingParams(max_new_tokens=3, temperature=0.0),
        )
        for res in result:
            assert res.error_code is None and res.custom_output.shape == (1, width)
            assert res.custom_output.dtype == torch.float32
            assert len(res.outputs[0].token_ids) >= 1
        assert not torch.equal(result[0].custom_output, result[1].custom_output)
        outputs[spec] = result
    probs = torch.cat([r.custom_output for r in outputs[str(CLASSIFIER)]])
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    assert (probs > 0).all()
