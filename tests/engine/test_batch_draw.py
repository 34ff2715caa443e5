"""The sampling fast paths (SamplingParams.batch_draw, from each field's `draw` metadata)
against the general path (a SampleRow per row), field by field: a request with one field of
SamplingParams set to a non-default value, alone and beside a default request (a mixed batch
draws as PLAIN), gives the same tokens, logprobs and finishes through an engine that takes
the fast paths (synchronously, and running ahead of its sampling) as through one that takes
the general path for every request (Engine.fast_draws False). Every field is covered: a new
one gets a non-default value from its default's type, or fails here until it has one.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, asdict, fields

import pytest

from tapserve.api.sampling_params import FAST_DRAWS, BatchDraw, SamplingParams
from tests.helpers.engine import make_llm, random_prompts, run

# non-default values that the validation accepts and that change what a request does;
# a field missing here takes one from its default's type (_from_type)
CASES: dict[str, list[dict]] = {
    "max_new_tokens": [{"max_new_tokens": 5}],
    "temperature": [{"temperature": 0.0}, {"temperature": 0.6}],
    "top_k": [{"top_k": 1}, {"top_k": 7}],
    "top_p": [{"top_p": 0.8}],
    "min_p": [{"min_p": 0.05}],
    "repetition_penalty": [{"repetition_penalty": 1.3}],
    "presence_penalty": [{"presence_penalty": 0.7}],
    "frequency_penalty": [{"frequency_penalty": 0.4}],
    "seed": [{"seed": 1234}],
    "n": [{"n": 3}],
    "num_beams": [{"num_beams": 2}],
    "length_penalty": [{"length_penalty": 0.5}],
    "stop": [{"stop": ["e"]}],
    "stop_token_ids": [{"stop_token_ids": list(range(100, 400))}],
    "min_tokens": [{"min_tokens": 4, "stop_token_ids": list(range(100, 400))}],
    "ignore_eos": [{"ignore_eos": True}],
    "logit_bias": [{"logit_bias": {5: 30.0, 17: -100.0}}],
    "logprobs": [{"logprobs": True}, {"logprobs": True, "top_logprobs": 3}],
    "top_logprobs": [{"top_logprobs": 3}],
    "skip_special_tokens": [{"skip_special_tokens": False}],
    "include_stop_str_in_output": [{"include_stop_str_in_output": True, "stop": ["e"]}],
}


def _from_type(f: Field) -> list[dict]:
    default = f.default_factory() if f.default is MISSING else f.default
    if isinstance(default, bool):
        return [{f.name: not default}]
    if isinstance(default, (int, float)):
        return [{f.name: default + 1}]
    pytest.fail(f"SamplingParams.{f.name}: give it a non-default value in CASES")


def _cases() -> list[tuple[str, dict]]:
    return [
        (f.name, kwargs)
        for f in fields(SamplingParams)
        for kwargs in CASES.get(f.name) or _from_type(f)
    ]


@pytest.fixture(scope="module")
def demo_dir():
    from tapserve.model.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


def test_every_field_says_which_fast_draws_tolerate_it():
    for f in fields(SamplingParams):
        draws = f.metadata.get("draw")
        assert isinstance(draws, frozenset), f"SamplingParams.{f.name} has no draw metadata"
        assert draws <= set(FAST_DRAWS), (f.name, draws)


def test_the_draw_is_the_first_fast_one_every_changed_field_tolerates():
    assert SamplingParams().batch_draw is BatchDraw.TEMPERATURE
    assert SamplingParams(temperature=0).batch_draw is BatchDraw.GREEDY
    assert SamplingParams(top_k=1, top_p=0.5).batch_draw is BatchDraw.GREEDY
    assert SamplingParams(top_p=0.5, stop=["x"], n=2).batch_draw is BatchDraw.PLAIN
    assert SamplingParams(temperature=0, seed=1).batch_draw is BatchDraw.GENERAL
    assert SamplingParams(num_beams=2).batch_draw is BatchDraw.GENERAL


def _counting_draws(llm) -> list[int]:
    """A one-item list counting the engine's batch draws (TokenSteps._draw_batch)."""
    tokens, calls = llm.engine.tokens, [0]
    draw = tokens._draw_batch

    def counted(*args):
        calls[0] += 1
        return draw(*args)

    tokens._draw_batch = counted
    return calls


def _outputs(results) -> list[list[dict]]:
    return [[asdict(o) for o in r.outputs] for r in results]


def _all_run_to_length(results) -> bool:
    """No sequence ended before the others (running ahead, a row that ends early was drawn
    in the step after: the shared generator's stream then differs from a synchronous one)."""
    outs = [o for r in results for o in r.outputs]
    return (
        all(o.finish_reason == "length" for o in outs)
        and len({len(o.token_ids) for o in outs}) == 1
    )


@pytest.mark.parametrize("name, kwargs", _cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_non_default_field_gives_the_general_paths_tokens(demo_dir, name, kwargs):
    params = SamplingParams(**kwargs)
    beside = SamplingParams(max_new_tokens=params.max_new_tokens)  # TEMPERATURE
    batches = [
        (random_prompts([11], 1000, seed=1), [params]),
        (random_prompts([9, 14], 1000, seed=2), [params, beside]),
    ]
    config = dict(num_kv_blocks=64, max_model_len=128, seed=7)
    draws, ahead_steps = {"general": 0, "fast": 0}, 0
    for prompts, batch_params in batches:  # fresh engines: each generator starts alike
        general = make_llm(demo_dir, async_scheduling=False, **config)
        general.engine.fast_draws = False
        fast = make_llm(demo_dir, async_scheduling=False, **config)
        ahead = make_llm(demo_dir, async_scheduling=True, **config)
        counts = {"general": _counting_draws(general), "fast": _counting_draws(fast)}
        want = run(general, prompts, batch_params)
        assert _outputs(run(fast, prompts, batch_params)) == _outputs(want), name
        got_ahead = run(ahead, prompts, batch_params)
        if _all_run_to_length(want):
            assert _outputs(got_ahead) == _outputs(want), name
        ahead_steps += ahead.engine.num_ahead_steps
        for key, calls in counts.items():
            draws[key] += calls[0]
    assert draws["general"] == 0
    if params.batch_draw is not BatchDraw.GENERAL:
        assert draws["fast"] > 0, f"{name}: the fast engine was meant to draw {params.batch_draw}"
        if params.n == 1:
            assert ahead_steps > 0, name
