"""Sampling: seeded requests reproduce whatever else is in the batch, top_k = 1 (and other
degenerate filters) equal greedy, n = 4 shares the prompt's blocks, and the logit processors
that transformers also has (repetition penalty, logprobs) agree with it."""

from __future__ import annotations

import pytest
import torch

from tapserve.api.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import (
    count_preemptions,
    greedy,
    hf_greedy,
    hf_logits,
    hf_model,
    make_llm,
    random_prompts,
    run,
    token_ids,
)

VOCAB = 512
BLOCK = 16
NEW = 32


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def llm(ckpt):
    return make_llm(ckpt, block_size=BLOCK)


@pytest.fixture(scope="module")
def hf(ckpt):
    return hf_model(ckpt)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([9, 23, 40, 1, 17], VOCAB, seed=31)


def sampled(seed: int | None = 7, **kwargs) -> SamplingParams:
    kwargs = (
        dict(max_new_tokens=NEW, temperature=0.8, top_p=0.95, top_k=100, seed=seed, ignore_eos=True)
        | kwargs
    )
    return SamplingParams(**kwargs)


# ---- seeded sampling ------------------------------------------------------------------------
def test_seeded_sampling_reproduces_when_the_batch_changes(ckpt, llm, prompts) -> None:
    target = prompts[2]
    alone = token_ids(run(llm, [target], sampled()))[0]
    assert alone == token_ids(run(llm, [target], sampled()))[0]
    # other requests (unseeded, greedy, other seeds, longer) around it, and it in the middle
    batch = [prompts[0], prompts[1], target, prompts[3], prompts[4]]
    params = [
        sampled(seed=None),
        greedy(NEW),
        sampled(),
        sampled(seed=8, temperature=1.3),
        sampled(seed=None, max_new_tokens=50),
    ]
    assert token_ids(run(llm, batch, params))[2] == alone
    # a different engine seed, chunked prefill and a different batch size
    other = make_llm(ckpt, block_size=BLOCK, seed=1234, max_num_batched_tokens=13)
    assert token_ids(run(other, [prompts[4], target], [sampled(seed=None), sampled()]))[1] == alone


def test_seeded_sampling_really_samples(llm, prompts) -> None:
    """Different seeds give different continuations (32 tokens at temperature 1)."""
    outs = token_ids(
        run(
            llm,
            [prompts[2]] * 3,
            [sampled(seed=s, temperature=1.0, top_k=0, top_p=1.0) for s in (1, 2, 3)],
        )
    )
    assert len({tuple(o) for o in outs}) == 3
    assert token_ids(run(llm, [prompts[2]], greedy(NEW)))[0] not in outs


def test_seeds_that_python_hashes_alike_draw_differently(llm, prompts) -> None:
    """Python's hash() takes integers modulo 2**61 - 1 and hashes -1 as -2: seeds the API
    accepts ([-2**63, 2**64)) drew identical tokens. Seeds equal modulo 2**64 stay one seed,
    as torch.Generator.manual_seed takes them."""
    m61 = 2**61 - 1
    seeds = [-1, -2, 0, m61, 12345, 12345 + m61, 2**64 - 1]
    outs = [
        tuple(o)
        for o in token_ids(
            run(
                llm,
                [prompts[2]] * len(seeds),
                [sampled(seed=s, temperature=1.0, top_k=0, top_p=1.0) for s in seeds],
            )
        )
    ]
    assert outs[0] != outs[1] and outs[2] != outs[3] and outs[4] != outs[5]
    assert outs[6] == outs[0]  # 2**64 - 1 is -1 modulo 2**64


def test_seeded_n_samples_reproduce(llm, prompts) -> None:
    """n = 4 seeded samples: each sample is reproducible, and they differ from each other."""
    params = sampled(n=4, temperature=1.0)
    first = [o.token_ids for o in run(llm, [prompts[1]], params)[0].outputs]
    again = [
        o.token_ids
        for o in run(llm, [prompts[0], prompts[1]], [sampled(seed=None), params])[1].outputs
    ]
    assert first == again
    assert len({tuple(o) for o in first}) == 4


# ---- degenerate filters equal greedy ------------------------------------------------------------
@pytest.mark.parametrize(
    "filters",
    [dict(top_k=1), dict(top_p=1e-9), dict(min_p=1.0), dict(top_k=1, seed=3, temperature=2.0)],
    ids=["top_k=1", "top_p~0", "min_p=1", "top_k=1-seeded"],
)
def test_filters_that_keep_one_token_equal_greedy(llm, hf, prompts, filters) -> None:
    kwargs = dict(max_new_tokens=NEW, temperature=1.0, ignore_eos=True) | filters
    got = token_ids(run(llm, prompts, SamplingParams(**kwargs)))
    assert got == token_ids(run(llm, prompts, greedy(NEW)))
    assert got == hf_greedy(hf, prompts, NEW)


# ---- n > 1 shares the prompt's blocks -----------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [40, 32])
def test_n_samples_allocate_the_prompt_once(ckpt, prompt_len) -> None:
    """n = 4: one prefill, the prompt's full blocks referenced by all four samples, only
    the partly filled last block copied (copy-on-write); greedy samples all equal greedy."""
    llm = make_llm(ckpt, block_size=BLOCK, num_kv_blocks=32)
    engine, blocks = llm.engine, llm.engine.blocks
    prompt = random_prompts([prompt_len], VOCAB, seed=32)[0]
    full = prompt_len // BLOCK
    engine.add_request("n4", prompt, greedy(NEW, n=4))
    engine.step()  # prefill + fork into 4 samples
    request = engine.requests["n4"]
    assert len(request.sequences) == 4
    engine.step()  # first decode: every sample has a slot for its token
    tables = [s.block_table for s in request.sequences]
    shared = tables[0][:full]
    assert all(t[:full] == shared for t in tables)
    assert all(blocks.blocks[b].ref_count == 4 for b in shared)
    tails = [b for t in tables for b in t[full:]]
    assert len(set(tails)) == len(tails), "blocks past the prompt's full blocks are private"
    assert all(blocks.blocks[b].ref_count == 1 for b in tails)
    used = blocks.num_blocks - blocks.num_free_blocks
    assert used == full + 4, "the prompt's full blocks are allocated once, not per sample"
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    final = {s.index: s.output_token_ids for s in request.sequences}
    reference = token_ids(run(make_llm(ckpt, block_size=BLOCK), [prompt], greedy(NEW)))[0]
    assert [final[i] for i in range(4)] == [reference] * 4


def test_n_samples_in_a_full_cache(ckpt, prompts) -> None:
    """n = 4 admitted when the cache is nearly full: sharing must not need blocks the
    scheduler did not account for (no crash; same samples as in a roomy cache)."""
    batch = [random_prompts([56], VOCAB, seed=33)[0], prompts[1]]  # 4 blocks; 2 blocks
    params = [greedy(40), sampled(n=4, temperature=1.0, max_new_tokens=8)]
    roomy = run(make_llm(ckpt, block_size=BLOCK), batch, params)
    tight = make_llm(ckpt, block_size=BLOCK, num_kv_blocks=8, max_model_len=8 * BLOCK)
    with count_preemptions(tight):
        got = run(tight, batch, params)
    for r, g in zip(roomy, got):
        assert [o.token_ids for o in r.outputs] == [o.token_ids for o in g.outputs]


# ---- logit processors against transformers ------------------------------------------------------
def test_repetition_penalty_matches_transformers(llm, hf, prompts) -> None:
    got = token_ids(run(llm, prompts, greedy(NEW, repetition_penalty=1.5)))
    assert got == hf_greedy(hf, prompts, NEW, repetition_penalty=1.5)
    assert got != token_ids(run(llm, prompts, greedy(NEW)))


def test_logprobs_match_transformers(llm, hf, prompts) -> None:
    """Logprobs (and top-3) of the chosen tokens are those of the raw model distribution."""
    params = SamplingParams(
        max_new_tokens=12, temperature=0.7, seed=5, logprobs=True, top_logprobs=3, ignore_eos=True
    )
    for r in run(llm, prompts[:3], params):
        out = r.outputs[0]
        ref = torch.log_softmax(hf_logits(hf, r.prompt_token_ids + out.token_ids), dim=-1)
        start = len(r.prompt_token_ids) - 1
        for k, (token, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
            row = ref[start + k]
            assert lp == pytest.approx(row[token].item(), abs=1e-4)
            vals, ids = row.topk(3)
            assert [t for t, _ in top] == ids.tolist()
            assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-4)
        assert out.cumulative_logprob == pytest.approx(sum(out.logprobs), abs=1e-3)


def test_stop_token_ids_and_min_tokens(llm, prompts) -> None:
    ref = token_ids(run(llm, [prompts[0]], greedy(NEW)))[0]
    k = next(k for k in range(2, NEW) if ref[k] not in ref[:k])
    stop = ref[k]
    out = run(llm, [prompts[0]], greedy(NEW, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == ref[: k + 1] and out.finish_reason == "stop"
    # min_tokens bans the stop token until k + 2 tokens exist
    out = run(llm, [prompts[0]], greedy(NEW, stop_token_ids=[stop], min_tokens=k + 2))[0].outputs[0]
    assert stop not in out.token_ids[: k + 2] and len(out.token_ids) >= k + 2


def test_logit_bias(llm, prompts) -> None:
    out = token_ids(run(llm, prompts[:2], greedy(8, logit_bias={77: 100.0})))
    assert out == [[77] * 8, [77] * 8]


def test_a_row_without_top_p_keeps_its_tail_beside_a_filtered_row() -> None:
    """A top_p=1 row takes the sort path when a neighbour asks top-k; its float32 mass
    before a tail token can exceed 1.0, and `before > top_p` dropped ~15k tokens of a
    151,936 vocabulary, so its draw depended on its batch."""
    from tapserve.coordinator.sampler import Sampler

    logits = torch.randn(2, 151936, generator=torch.Generator().manual_seed(0)) * 3
    alone = Sampler._filtered_probs(logits[:1], [SamplingParams(temperature=1.0)])
    beside = Sampler._filtered_probs(
        logits, [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=20000)]
    )
    assert int((alone[0] > 0).sum()) == 151936
    assert int((beside[0] > 0).sum()) == 151936
    assert int((beside[1] > 0).sum()) == 20000
