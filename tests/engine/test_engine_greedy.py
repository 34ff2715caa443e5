"""Greedy generation against transformers: token ids identical to `model.generate` and the
logits of every sampled position allclose, for Qwen3, Qwen2 and Llama (Llama-3 rope scaling),
on a batch of prompts of different lengths (1 token, around block boundaries)."""

from __future__ import annotations

import pytest

from tapserve.api import wire
from tests.helpers.checkpoints import ARCHS, make_tiny_checkpoint
from tests.helpers.engine import (
    assert_logits_match,
    capture_logits,
    capture_plans,
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
# 1 token, around one and two block boundaries, several blocks
LENGTHS = [1, 3, 15, 16, 17, 31, 32, 33, 48, 57]
NEW_TOKENS = 40


@pytest.fixture(scope="module", params=ARCHS)
def setup(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch)
    llm = make_llm(path, block_size=BLOCK)
    model = hf_model(path)
    prompts = random_prompts(LENGTHS, VOCAB, seed=ARCHS.index(arch))
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    return arch, path, llm, model, prompts, expected


def test_checkpoint_has_expected_architecture(setup) -> None:
    arch, _, llm, model, _, _ = setup
    cfg = llm.runner.model_cfg
    assert cfg.architecture == arch
    assert cfg.qk_norm == (arch == "qwen3") and cfg.attention_bias == (arch == "qwen2")
    if arch == "llama":
        assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.tie_word_embeddings == bool(model.config.tie_word_embeddings)


def test_greedy_tokens_match_transformers(setup) -> None:
    _, _, llm, _, prompts, expected = setup
    results = run(llm, prompts, greedy(NEW_TOKENS))
    got = token_ids(results)
    assert all(len(t) == NEW_TOKENS for t in expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens) diverges from transformers"
    assert all(r.outputs[0].finish_reason == "length" for r in results)


def test_logits_match_transformers(setup) -> None:
    """The prefill's last-position logits and every decode step's logits (atol 1e-4)."""
    _, _, llm, model, prompts, _ = setup
    with capture_logits(llm) as records:
        results = run(llm, prompts, greedy(NEW_TOKENS))
    assert len(records) == len(prompts)
    assert all(len(rows) == NEW_TOKENS for rows in records.values())
    # the first row of each request is the prompt's last position
    for r in results:
        assert records[(r.request_id, 0)][0][0] == len(r.prompt_token_ids) - 1
    assert assert_logits_match(model, records, results) == len(prompts) * NEW_TOKENS


def test_batch_is_really_batched(setup) -> None:
    """All prompts share the first step's prefill and later steps are pure decodes."""
    _, path, _, _, prompts, expected = setup
    llm = make_llm(path, block_size=BLOCK)  # a cold prefix cache
    with capture_plans(llm) as plans:
        results = run(llm, prompts, greedy(NEW_TOKENS))
    assert token_ids(results) == expected
    assert plans[0].num_seqs == len(prompts) and plans[0].num_tokens == sum(LENGTHS)
    assert len(plans) == NEW_TOKENS
    assert all(p.num_seqs == len(prompts) and p.num_tokens == len(prompts) for p in plans[1:])


def test_continuous_batching_matches_transformers(setup) -> None:
    """At most 3 sequences at a time and block size 8: requests join while others decode
    (mixed prefill + decode steps) and still give transformers' tokens."""
    _, path, _, _, prompts, expected = setup
    llm = make_llm(path, block_size=8, max_num_seqs=3, max_num_batched_tokens=64)
    with capture_plans(llm) as plans:
        results = run(llm, prompts, greedy(NEW_TOKENS))
    assert token_ids(results) == expected
    mixed = [
        p
        for p in plans
        if p.num_tokens > p.num_seqs
        and p.num_seqs > 1
        and min(p.query_start_loc[1:] - p.query_start_loc[:-1]) == 1
    ]
    assert mixed, "expected steps that mix decodes with a new request's prefill"
    assert max(p.num_seqs for p in plans) <= 3


def test_decode_news_travel_in_token_columns(setup) -> None:
    """Past its first token, a running n = 1 request without logprobs sends its new token in
    the Outputs columns; one with logprobs (or finishing) sends a full RequestOutput. What
    arrives through the wire codec gives transformers' tokens, and a logprob for every token."""
    _, path, _, _, prompts, expected = setup
    llm = make_llm(path, block_size=BLOCK)
    engine = llm.engine
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", p, greedy(NEW_TOKENS, logprobs=i == 3))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    logprobs: list[float] = []
    column_steps = 0
    while engine.has_work():
        step = engine.step()
        if 0 < len(step.token_request_ids):
            column_steps += 1
            assert "r3" not in step.token_request_ids  # logprobs: always a full output
            assert sorted(step.token_request_ids) == ["r0", "r1", "r2"]
        for out in wire.decode(wire.encode(step)):
            for s in out.sequences:
                got[out.request_id] += s.new_token_ids
                logprobs += s.new_logprobs or []
    # the first token (a full output) and the last (finished) are not in the columns
    assert column_steps == NEW_TOKENS - 2
    assert [got[f"r{i}"] for i in range(4)] == expected[:4]
    assert len(logprobs) == NEW_TOKENS and all(lp <= 0 for lp in logprobs)


def test_outputs_codec_round_trips_the_columns() -> None:
    full = wire.RequestOutput(
        "a", sequences=[wire.SequenceOutput(0, [7], finish_reason="stop")], finished=True
    )
    step = wire.Outputs([full], ["b", "c"], [11, 12])
    back = wire.decode(wire.encode(step))
    assert back == step and len(back) == 3
    a, b, c = list(back)
    assert a == full
    assert (b.request_id, b.sequences[0].new_token_ids, b.finished) == ("b", [11], False)
    assert (c.request_id, c.sequences[0].index, c.sequences[0].new_token_ids) == ("c", 0, [12])


def test_block_tables_travel_as_uint16_while_the_pool_allows(setup) -> None:
    """A pool of at most 65,536 blocks: plans carry uint16 tables (ranks.plan.block_table_dtype),
    and the tokens above matched transformers through them."""
    _, _, llm, _, prompts, expected = setup
    with capture_plans(llm) as plans:
        results = run(llm, prompts[:3], greedy(4))
    assert {p.block_tables.dtype.name for p in plans} == {"uint16"}
    assert token_ids(results) == [e[:4] for e in expected[:3]]


def test_block_ids_past_uint16_travel_as_int32(tmp_path) -> None:
    """A pool of more than 65,536 blocks, its allocator made to hand out ids that cross 65,535
    first: plans carry int32 tables, and the greedy tokens still equal transformers'."""
    path = make_tiny_checkpoint(tmp_path, "qwen3")
    llm = make_llm(path, block_size=8, num_kv_blocks=65_600)  # 4 KB a block: 269 MB in all
    free = llm.engine.blocks.free
    for block_id in range(65_500):  # the allocator takes the least recently freed first
        free.move_to_end(block_id)
    prompts = random_prompts(LENGTHS, VOCAB, seed=0)
    with capture_plans(llm) as plans:
        results = run(llm, prompts, greedy(NEW_TOKENS))
    assert {p.block_tables.dtype.name for p in plans} == {"int32"}
    assert max(int(p.block_tables.max()) for p in plans) > 65_535
    assert token_ids(results) == hf_greedy(hf_model(path), prompts, NEW_TOKENS)
