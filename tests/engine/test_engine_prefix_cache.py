"""Prefix cache, eviction, preemption and chunked prefill: whatever the engine reuses,
evicts, recomputes or splits, the tokens are those of a cold run (and of transformers)."""

from __future__ import annotations

import pytest

from tapserve.api.sampling_params import SamplingParams
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import (
    assert_logits_match,
    capture_logits,
    capture_plans,
    count_preemptions,
    greedy,
    hf_greedy,
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
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def cold(ckpt):
    """Reference engine: no prefix caching, room for everything."""
    return make_llm(ckpt, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts():
    """A 3-block prefix (48 tokens) shared by prompts with different tails."""
    prefix, a, b, other = random_prompts([3 * BLOCK, 7, 11, 60], VOCAB, seed=11)
    return {"prefix": prefix, "a": prefix + a, "b": prefix + b, "other": other}


def cold_tokens(cold, prompt_list, params=None):
    return token_ids(run(cold, prompt_list, params or greedy(NEW)))


def test_shared_three_block_prefix_reports_48_cached_tokens(ckpt, cold, prompts) -> None:
    llm = make_llm(ckpt, block_size=BLOCK)
    first = run(llm, [prompts["a"]], greedy(NEW))[0]
    assert first.num_cached_tokens == 0
    second = run(llm, [prompts["b"]], greedy(NEW))[0]
    assert second.num_cached_tokens == 3 * BLOCK
    assert second.outputs[0].token_ids == cold_tokens(cold, [prompts["b"]])[0]
    assert llm.engine.blocks.stats.hit_tokens == 3 * BLOCK
    # the same prompt again: still 48 (55 tokens, the last one is always computed)
    again = run(llm, [prompts["a"]], greedy(NEW))[0]
    assert again.num_cached_tokens == 3 * BLOCK
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_logits_with_cached_prefix_match_transformers(ckpt, prompts) -> None:
    llm = make_llm(ckpt, block_size=BLOCK)
    run(llm, [prompts["a"]], greedy(4))
    with capture_logits(llm) as records:
        results = run(llm, [prompts["b"]], greedy(NEW))
    assert results[0].num_cached_tokens == 3 * BLOCK
    assert assert_logits_match(hf_model(ckpt), records, results) == NEW


def test_block_aligned_prompt_recomputes_its_last_token(ckpt, cold, prompts) -> None:
    """A prompt that is exactly the cached 48 tokens reuses 2 blocks: the last prompt token
    is always computed (its logits are needed)."""
    llm = make_llm(ckpt, block_size=BLOCK)
    run(llm, [prompts["a"]], greedy(4))
    out = run(llm, [prompts["prefix"]], greedy(NEW))[0]
    assert out.num_cached_tokens == 2 * BLOCK
    assert out.outputs[0].token_ids == cold_tokens(cold, [prompts["prefix"]])[0]


def test_generated_tokens_are_cached_too(ckpt, cold, prompts) -> None:
    """Blocks filled during decode enter the cache: a follow-up prompt made of a previous
    prompt and its answer reuses them."""
    llm = make_llm(ckpt, block_size=BLOCK)
    first = run(llm, [prompts["a"]], greedy(NEW))[0]
    follow_up = prompts["a"] + first.outputs[0].token_ids + [5, 6, 7]
    computed = len(prompts["a"]) + NEW - 1  # the last generated token never ran through the model
    out = run(llm, [follow_up], greedy(NEW))[0]
    assert out.num_cached_tokens == computed // BLOCK * BLOCK
    assert out.outputs[0].token_ids == cold_tokens(cold, [follow_up])[0]


def test_prefix_shared_within_one_batch(ckpt, cold, prompts) -> None:
    """Requests sharing a prefix in the same generate call give cold-run tokens."""
    llm = make_llm(ckpt, block_size=BLOCK)
    batch = [prompts["a"], prompts["b"], prompts["a"], prompts["prefix"]]
    assert token_ids(run(llm, batch, greedy(NEW))) == cold_tokens(cold, batch)


def test_eviction_under_memory_pressure(ckpt, cold, prompts) -> None:
    """12 blocks: caching a, then other requests that need the whole cache evict a's
    blocks; b then finds nothing cached and still gives the cold tokens."""
    llm = make_llm(ckpt, block_size=BLOCK, num_kv_blocks=12, max_model_len=12 * BLOCK)
    run(llm, [prompts["a"]], greedy(NEW))
    fillers = random_prompts([150, 140], VOCAB, seed=12)
    assert token_ids(run(llm, fillers, greedy(30))) == cold_tokens(cold, fillers, greedy(30))
    out = run(llm, [prompts["b"]], greedy(NEW))[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == cold_tokens(cold, [prompts["b"]])[0]


def test_eviction_is_least_recently_used(ckpt, cold, prompts) -> None:
    """Two cached prefixes, then a request that needs part of the free space: the prefix
    freed first is evicted (from its tail), the one freed last survives whole."""
    llm = make_llm(ckpt, block_size=BLOCK, num_kv_blocks=10, max_model_len=10 * BLOCK)
    other_prefix = prompts["other"][: 3 * BLOCK]
    run(llm, [prompts["a"]], greedy(16))  # 71 tokens: 5 blocks
    run(llm, [prompts["other"]], greedy(16))  # 75 tokens: 5 blocks, freed last
    assert llm.engine.blocks.num_free_blocks == 10
    run(llm, random_prompts([33], VOCAB, seed=13), greedy(8))  # needs 3 blocks
    o = run(llm, [other_prefix + [9, 9, 9]], greedy(NEW))[0]
    b = run(llm, [prompts["b"]], greedy(NEW))[0]
    assert o.num_cached_tokens == 3 * BLOCK
    assert b.num_cached_tokens < 3 * BLOCK
    assert b.outputs[0].token_ids == cold_tokens(cold, [prompts["b"]])[0]
    assert o.outputs[0].token_ids == cold_tokens(cold, [other_prefix + [9, 9, 9]])[0]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_tiny_kv_budget(ckpt, cold, prefix_caching) -> None:
    """8 blocks for 6 requests that each grow to 4-5 blocks: running requests are preempted
    and recomputed, and every request still gets the cold-run tokens."""
    batch = random_prompts([20, 35, 9, 40, 28, 17], VOCAB, seed=14)
    llm = make_llm(
        ckpt,
        block_size=BLOCK,
        num_kv_blocks=8,
        max_model_len=8 * BLOCK,
        enable_prefix_caching=prefix_caching,
    )
    with count_preemptions(llm) as preempted:
        got = token_ids(run(llm, batch, greedy(40)))
    assert preempted, "the KV budget was meant to force preemption"
    assert got == cold_tokens(cold, batch, greedy(40))


def test_preemption_with_n_samples(ckpt, cold) -> None:
    """n = 3 seeded samples per request survive preemption (recompute) unchanged."""
    batch = random_prompts([20, 30, 12], VOCAB, seed=15)
    params = SamplingParams(max_new_tokens=30, temperature=0.9, n=3, seed=5, ignore_eos=True)
    roomy = run(cold, batch, params)
    llm = make_llm(ckpt, block_size=BLOCK, num_kv_blocks=14, max_model_len=14 * BLOCK)
    with count_preemptions(llm) as preempted:
        tight = run(llm, batch, params)
    assert preempted
    for r, t in zip(roomy, tight):
        assert [o.token_ids for o in r.outputs] == [o.token_ids for o in t.outputs]


@pytest.mark.parametrize("budget", [7, 16, 40])
def test_chunked_prefill_gives_the_same_tokens(ckpt, cold, prompts, budget) -> None:
    batch = [prompts["a"], prompts["other"], [42], prompts["b"]]
    llm = make_llm(
        ckpt, block_size=BLOCK, max_num_batched_tokens=budget, enable_prefix_caching=False
    )
    with capture_plans(llm) as plans:
        got = token_ids(run(llm, batch, greedy(NEW)))
    assert max(p.num_tokens for p in plans) <= budget
    assert got == cold_tokens(cold, batch)


def test_chunked_prefill_logits_match_transformers(ckpt, prompts) -> None:
    """A prompt prefilled 7 tokens at a time (over its own cached chunks) gives the logits
    of transformers."""
    llm = make_llm(ckpt, block_size=BLOCK, max_num_batched_tokens=7)
    batch = [prompts["other"], prompts["a"]]
    with capture_logits(llm) as records:
        results = run(llm, batch, greedy(8))
    assert assert_logits_match(hf_model(ckpt), records, results) == 2 * 8


def test_chunked_prefill_with_prefix_cache(ckpt, cold, prompts) -> None:
    llm = make_llm(ckpt, block_size=BLOCK, max_num_batched_tokens=10)
    run(llm, [prompts["a"]], greedy(4))
    out = run(llm, [prompts["b"]], greedy(NEW))[0]
    assert out.num_cached_tokens == 3 * BLOCK
    assert out.outputs[0].token_ids == cold_tokens(cold, [prompts["b"]])[0]


def test_cold_engine_matches_transformers(ckpt, cold, prompts) -> None:
    """The reference of this file is itself transformers' greedy output."""
    batch = [prompts["a"], prompts["b"], prompts["other"]]
    assert cold_tokens(cold, batch) == hf_greedy(hf_model(ckpt), batch, NEW)


def test_sequence_longer_than_the_kv_cache(ckpt, cold) -> None:
    """4 blocks (64 tokens) and the model's 1024-token context: a sequence stops with
    "length" when the cache is full instead of preempting itself forever, and a prompt
    that cannot fit is refused as too long."""
    llm = make_llm(ckpt, block_size=BLOCK, num_kv_blocks=4)
    prompt = random_prompts([30], VOCAB, seed=16)[0]
    out = run(llm, [prompt], greedy(60))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4 * BLOCK - 30
    assert out.token_ids == cold_tokens(cold, [prompt], greedy(60))[0][: len(out.token_ids)]
    refused = llm.generate([list(range(70))], greedy(4), raise_errors=False)[0]
    assert refused.error_code is not None and "too long" in refused.error_message


def test_n_samples_that_only_fit_one_at_a_time(ckpt, cold) -> None:
    """n = 3 samples of 4 blocks each in a 9-block cache: they cannot all run at once, so
    samples are preempted and recomputed on their own, and the request still completes."""
    prompt = random_prompts([30], VOCAB, seed=17)[0]
    params = SamplingParams(max_new_tokens=30, temperature=0.9, n=3, seed=6, ignore_eos=True)
    roomy = [o.token_ids for o in run(cold, [prompt], params)[0].outputs]
    llm = make_llm(ckpt, block_size=BLOCK, num_kv_blocks=9)
    with count_preemptions(llm) as preempted:
        tight = [o.token_ids for o in run(llm, [prompt], params)[0].outputs]
    assert preempted
    assert tight == roomy
