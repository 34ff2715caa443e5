"""Beam search against transformers' `generate(num_beams=4, num_return_sequences=4)` with EOS
disabled and length_penalty 1.0: the same beams, in the same order, with the same scores
(`sequences_scores`). Pinned to the transformers major version of engine_helpers."""

from __future__ import annotations

import pytest
import torch

from tapserve.api.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import (
    count_preemptions,
    greedy,
    hf_greedy,
    hf_model,
    make_llm,
    random_prompts,
    require_transformers_major,
    run,
    token_ids,
)

VOCAB = 512
BEAMS = 4
NEW = 24
LENGTHS = [1, 17, 40]


@pytest.fixture(scope="module", autouse=True)
def pinned_transformers():
    require_transformers_major()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def setup(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch)
    model = hf_model(path)
    prompts = random_prompts(LENGTHS, VOCAB, seed=21)
    return path, model, prompts, [hf_beams(model, p, NEW) for p in prompts]


@torch.no_grad()
def hf_beams(model, prompt: list[int], max_new_tokens: int, length_penalty: float = 1.0):
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=BEAMS,
        num_return_sequences=BEAMS,
        length_penalty=length_penalty,
        early_stopping=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    seqs = [row[len(prompt) :].tolist() for row in out.sequences]
    return seqs, out.sequences_scores.tolist()


def beam_params(**kwargs) -> SamplingParams:
    kwargs = (
        dict(
            max_new_tokens=NEW,
            temperature=0.0,
            num_beams=BEAMS,
            n=BEAMS,
            ignore_eos=True,
            length_penalty=1.0,
        )
        | kwargs
    )
    return SamplingParams(**kwargs)


def assert_beams_match(result, expected) -> None:
    seqs, scores = expected
    assert len(result.outputs) == BEAMS
    got = [o.token_ids for o in result.outputs]
    assert got == seqs
    torch.testing.assert_close(
        torch.tensor([o.cumulative_logprob for o in result.outputs], dtype=torch.float64),
        torch.tensor(scores, dtype=torch.float64),
        atol=1e-4,
        rtol=0,
    )
    assert all(o.finish_reason == "length" for o in result.outputs)


def test_beams_and_scores_match_transformers(setup) -> None:
    path, _, prompts, expected = setup
    llm = make_llm(path)
    results = run(llm, prompts, beam_params())
    for r, e in zip(results, expected):
        assert_beams_match(r, e)


def test_beams_beside_greedy_requests(setup) -> None:
    """Beam requests batched with plain greedy requests: both kinds are unaffected."""
    path, model, prompts, expected = setup
    llm = make_llm(path)
    others = random_prompts([5, 33], VOCAB, seed=22)
    params = [greedy(NEW), beam_params(), greedy(NEW), beam_params()]
    results = run(llm, [others[0], prompts[1], others[1], prompts[2]], params)
    assert_beams_match(results[1], expected[1])
    assert_beams_match(results[3], expected[2])
    assert token_ids([results[0], results[2]]) == hf_greedy(model, others, NEW)


def test_fewer_returned_sequences(setup) -> None:
    """n = 2 of 4 beams: the two best of transformers' four."""
    path, _, prompts, expected = setup
    llm = make_llm(path)
    r = run(llm, [prompts[1]], beam_params(n=2))[0]
    seqs, scores = expected[1]
    assert [o.token_ids for o in r.outputs] == seqs[:2]
    assert [o.cumulative_logprob for o in r.outputs] == pytest.approx(scores[:2], abs=1e-4)


def test_beams_with_a_small_token_budget(setup) -> None:
    """8 beams decoding under a 6-token step budget: a request's beams must still advance
    together."""
    path, _, prompts, expected = setup
    llm = make_llm(path, max_num_batched_tokens=6)
    results = run(llm, prompts[1:], beam_params())
    for r, e in zip(results, expected[1:]):
        assert_beams_match(r, e)


@pytest.mark.parametrize("budget", [8192, 10])
def test_beams_survive_preemption(setup, budget) -> None:
    """16 blocks for a long greedy request and two beam requests of up to 4 x 3 and 4 x 4
    blocks: beams are preempted (together) and recomputed (with a 10-token budget: in
    chunks, the beams still sampling in one step), and nothing changes."""
    path, model, prompts, expected = setup
    llm = make_llm(path, num_kv_blocks=16, max_num_batched_tokens=budget)
    other = random_prompts([60], VOCAB, seed=23)
    with count_preemptions(llm) as preempted:
        results = run(llm, other + prompts[1:], [greedy(NEW), beam_params(), beam_params()])
    assert preempted, "the KV budget was meant to force preemption"
    assert token_ids(results[:1]) == hf_greedy(model, other, NEW)
    for r, e in zip(results[1:], expected[1:]):
        assert_beams_match(r, e)


def test_length_penalty(setup) -> None:
    """length_penalty != 1 only rescales finished scores here (all beams end at max length)."""
    path, model, prompts, _ = setup
    llm = make_llm(path)
    r = run(llm, [prompts[1]], beam_params(length_penalty=0.5))[0]
    assert_beams_match(r, hf_beams(model, prompts[1], NEW, length_penalty=0.5))


@torch.no_grad()
def test_stop_token_ids_and_min_tokens_match_transformers(setup) -> None:
    """A stop token id ends a hypothesis as transformers' extra eos_token_id does, and not
    before min_tokens (transformers' min_new_tokens): the same beams and scores. The stop
    id is a token the unstopped best beam takes second, so it would end it at 2 tokens."""
    path, model, prompts, expected = setup
    llm = make_llm(path)
    for prompt, (seqs, _) in zip(prompts[1:], expected[1:]):
        stop = seqs[0][1]
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            do_sample=False,
            num_beams=BEAMS,
            num_return_sequences=BEAMS,
            length_penalty=1.0,
            early_stopping=False,
            eos_token_id=[stop],
            pad_token_id=stop,
            min_new_tokens=4,
            output_scores=True,
            return_dict_in_generate=True,
        )
        want = []
        for row in out.sequences:
            new = row[len(prompt) :].tolist()
            want.append(new[: new.index(stop) + 1] if stop in new else new)
        (result,) = run(llm, [prompt], beam_params(stop_token_ids=[stop], min_tokens=4))
        got = [o.token_ids for o in result.outputs]
        assert got == want, (stop, got, want)
        assert all(len(g) >= 4 for g in got)
        torch.testing.assert_close(
            torch.tensor([o.cumulative_logprob for o in result.outputs], dtype=torch.float64),
            out.sequences_scores.double(),
            atol=1e-4,
            rtol=0,
        )


@torch.no_grad()
def test_repetition_penalty_matches_transformers(setup) -> None:
    """transformers applies its repetition penalty to each beam's log-probabilities; it was
    ignored here (the same beams with or without it). The penalty used is strong enough to
    change the beams on these prompts."""
    path, model, prompts, expected = setup
    llm = make_llm(path)
    for prompt, (unpenalized, _) in zip(prompts, expected):
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            do_sample=False,
            num_beams=BEAMS,
            num_return_sequences=BEAMS,
            early_stopping=False,
            repetition_penalty=3.0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        want = (
            [row[len(prompt) :].tolist() for row in out.sequences],
            out.sequences_scores.tolist(),
        )
        assert want[0] != unpenalized
        assert_beams_match(run(llm, [prompt], beam_params(repetition_penalty=3.0))[0], want)


def test_extreme_length_penalties_score_without_crashing(setup) -> None:
    """A length penalty whose power overflows (1e30) or underflows (-2000) gives the limit of
    the score; it raised OverflowError / ZeroDivisionError, which ended the engine. Beam
    search with a sampling-only penalty is refused."""
    from tapserve.coordinator.beam_search import length_normalized

    assert length_normalized(-3.0, 4, 1e30) == 0.0 and length_normalized(-3.0, 4, -2000) == -float(
        "inf"
    )
    assert length_normalized(-3.0, 1, 1e30) == -3.0 and length_normalized(-3.0, 4, 0.5) == -1.5
    path, _, prompts, expected = setup
    llm = make_llm(path)
    for penalty in (1e30, -2000.0):
        (r,) = run(llm, [prompts[1]], beam_params(length_penalty=penalty, max_new_tokens=4))
        assert len(r.outputs) == BEAMS and all(len(o.token_ids) == 4 for o in r.outputs)
    assert_beams_match(run(llm, [prompts[1]], beam_params())[0], expected[1])  # goes on serving
    for field in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ValueError, match="do not apply to beam search"):
            beam_params(**{field: 0.5})
