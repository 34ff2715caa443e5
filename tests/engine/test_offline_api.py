"""The offline LLM as a vLLM user calls it, on the embedded demo model (its tokenizer is the
reference for the text): the text the API process would write, one string as one prompt,
token-id prompts checked, no cumulative log-probability where none was computed, the
model's generation_config.json defaults, and raise_errors covering failures after admission."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from tapserve.api.sampling_params import SamplingParams
from tapserve.coordinator.config import EngineConfig
from tapserve.coordinator.custom_outputs import RequestError
from tapserve.coordinator.offline import LLM
from tapserve.model.demo import ensure_demo_checkpoint

PROMPT = "Hello there"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        EngineConfig(device="cpu", max_num_seqs=4, custom_module="tapserve.model.demo:DemoHead")
    )


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_demo_checkpoint())


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, **kwargs)


def test_a_stop_token_leaves_its_text_out_unless_asked(llm, tokenizer) -> None:
    ids = llm.generate([PROMPT], greedy(max_new_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    stop = ids[3]
    cut = llm.generate([PROMPT], greedy(max_new_tokens=8, stop_token_ids=[stop]))[0].outputs[0]
    assert cut.token_ids == ids[:4] and cut.finish_reason == "stop"
    assert cut.text == tokenizer.decode(ids[:3], skip_special_tokens=True)
    kept = llm.generate(
        [PROMPT], greedy(max_new_tokens=8, stop_token_ids=[stop], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == tokenizer.decode(ids[:4], skip_special_tokens=True)


def test_skip_special_tokens_off_shows_them(llm, tokenizer) -> None:
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    params = dict(max_new_tokens=3, logit_bias={special: 100}, ignore_eos=True)
    shown = llm.generate([PROMPT], greedy(**params, skip_special_tokens=False))[0].outputs[0]
    assert shown.token_ids == [special] * 3 and shown.text == "<|im_start|>" * 3
    assert llm.generate([PROMPT], greedy(**params))[0].outputs[0].text == ""


def test_one_string_is_one_prompt(llm, tokenizer) -> None:
    (result,) = llm.generate(PROMPT, greedy(max_new_tokens=2))
    assert result.prompt_token_ids == tokenizer.encode(PROMPT)


@pytest.mark.parametrize("prompt", [[5.5, 6.9], [True, False], [[5, 6]], 5])
def test_token_id_prompts_must_be_integers(llm, prompt) -> None:
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([prompt], greedy(max_new_tokens=1))


def test_numpy_prompts_and_params_give_python_numbers(llm) -> None:
    for prompt in (np.array([5, 6, 7]), [np.int64(5), np.int32(6), 7]):
        (result,) = llm.generate([prompt], greedy(max_new_tokens=1))
        assert result.prompt_token_ids == [5, 6, 7] and type(result.prompt_token_ids[0]) is int
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint64(7))
    assert (type(params.temperature), type(params.top_k), type(params.seed)) == (float, int, int)
    assert llm.generate([PROMPT], params)[0].error_code is None


def test_text_is_the_api_text_when_a_stop_token_follows_an_open_character(llm, tokenizer) -> None:
    """A held lead byte before a left-out stop token is dropped, as the API drops it (the
    stop token might have completed its character); a decode of the ids before the stop
    token kept its U+FFFD."""
    lead = tokenizer.convert_tokens_to_ids("Ã")  # the byte 0xC3, which opens a character
    stop = tokenizer.convert_tokens_to_ids("a")
    # the lead byte first, until the penalties let the stop token win
    params = greedy(
        max_new_tokens=8,
        ignore_eos=True,
        logit_bias={lead: 100, stop: 97},
        presence_penalty=2,
        frequency_penalty=2,
        stop_token_ids=[stop],
    )
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids[-1] == stop and set(out.token_ids[:-1]) == {lead}
    full = tokenizer.decode(out.token_ids[:-1])
    assert full.endswith("\ufffd") and out.text == full[:-1]


def test_cumulative_logprob_only_where_computed(llm) -> None:
    (plain,) = llm.generate([PROMPT], SamplingParams(max_new_tokens=3, n=2, seed=1))
    assert [o.cumulative_logprob for o in plain.outputs] == [None, None]
    (scored,) = llm.generate([PROMPT], SamplingParams(max_new_tokens=3, n=2, seed=1, logprobs=True))
    for o in scored.outputs:
        assert o.cumulative_logprob == pytest.approx(sum(o.logprobs), abs=1e-5)


def test_seed_beyond_the_wire_is_refused() -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)
    with pytest.raises(ValueError, match="top_p is beyond float's range"):
        SamplingParams(top_p=10**400)  # (OverflowError, which callers do not catch)
    for kwargs in (
        {"logit_bias": {1: 10**400}},
        {"logit_bias": {float("inf"): 1}},
        {"stop_token_ids": [1.7]},
        {"logit_bias": {1: None}},
        {"stop_token_ids": ["7"]},
    ):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(**kwargs)


def test_none_is_no_stop_strings_and_an_empty_one_is_refused() -> None:
    """As vLLM: stop=None is none (it was a TypeError: a reviewer); "" is refused."""
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop="x").stop == ["x"]
    for stop in ("", ["a", ""], [3]):
        with pytest.raises(ValueError, match="stop must hold non-empty strings"):
            SamplingParams(stop=stop)


def test_misused_params_are_named(llm) -> None:
    with pytest.raises(ValueError, match="temperature must be a number"):
        SamplingParams(temperature="0.5")
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([PROMPT], {"temperature": 0})


def test_no_params_take_the_model_generation_config(tmp_path) -> None:
    """As the server (--generation-config auto) and vLLM: a folder whose
    generation_config.json says top_k 1 samples greedily when no params are given."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(ensure_demo_checkpoint(), folder)
    (folder / "generation_config.json").write_text(json.dumps({"top_k": 1, "temperature": 1.5}))
    llm = LLM(EngineConfig(model=str(folder), device="cpu", max_num_seqs=4))
    assert llm.model_defaults == {"top_k": 1, "temperature": 1.5}
    expected = llm.generate([PROMPT], greedy(max_new_tokens=6, ignore_eos=True))[0].outputs[0]
    for _ in range(3):
        got = llm.generate([PROMPT])[0].outputs[0]  # max_new_tokens: SamplingParams' own
        assert got.token_ids[:6] == expected.token_ids[: len(got.token_ids[:6])]


def test_a_head_failure_after_admission_raises(llm) -> None:
    """raise_errors (the default) raises for a 606 from the head's forward too, once the
    call's requests have ended; False leaves it on the result."""
    handler = llm.engine.handler
    forward = handler.forward
    handler.forward = lambda hidden: (_ for _ in ()).throw(RuntimeError("head down"))
    try:
        (result,) = llm.generate([PROMPT], greedy(max_new_tokens=2), raise_errors=False)
        assert result.error_code == 606 and "head down" in result.error_message
        with pytest.raises(RequestError, match="head down") as e:
            llm.generate([PROMPT, "other"], greedy(max_new_tokens=2))
        assert e.value.code == 606
    finally:
        handler.forward = forward
    assert not llm.engine.has_work()
    assert llm.generate([PROMPT], greedy(max_new_tokens=2))[0].error_code is None
