"""The per-step block-accounting check (tests/helpers/invariants.py) that engines built by the test
helpers run after every step: it runs, it holds through forks, beams and preemption, and it
catches broken accounting."""

from __future__ import annotations

import pytest

from tapserve.api.sampling_params import SamplingParams
from tests.helpers.engine import count_preemptions, make_llm, random_prompts, run
from tests.helpers.invariants import block_counts, check_engine


@pytest.fixture(scope="module")
def demo_dir():
    from tapserve.model.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


def test_checked_after_every_step_through_preemption_forks_and_beams(demo_dir):
    llm = make_llm(demo_dir, num_kv_blocks=10, block_size=16, max_model_len=160)
    prompts = random_prompts([20, 30, 25, 40, 18, 33], 1000, seed=1)
    params = [
        SamplingParams(max_new_tokens=40, temperature=0.7, n=1 + i % 3, ignore_eos=True, seed=i)
        for i in range(len(prompts))
    ]
    with count_preemptions(llm) as preempted:
        run(llm, prompts, params)
    assert preempted, "the tiny cache was meant to force preemption"
    beams = SamplingParams(max_new_tokens=6, num_beams=3, temperature=0.0)
    run(llm, prompts[:2], beams)
    assert llm.engine.steps_checked > 20
    counts = block_counts(llm.engine)
    assert counts["used"] == 0 and sum(counts[k] for k in ("free", "used", "cached")) == 10


def test_checker_catches_broken_accounting(demo_dir):
    llm = make_llm(demo_dir, num_kv_blocks=16)
    engine = llm.engine
    engine.add_request("r", random_prompts([40], 1000)[0], SamplingParams(max_new_tokens=5))
    engine.step()  # the prefill: the request holds 3 blocks
    seq = engine.requests["r"].sequences[0]
    block = engine.blocks.blocks[seq.block_table[0]]
    block.ref_count += 1  # a reference nobody holds
    with pytest.raises(AssertionError, match="ref_count"):
        check_engine(engine)
    block.ref_count -= 1
    engine.blocks.free[seq.block_table[1]] = None  # a used block on the free list
    with pytest.raises(AssertionError, match="free list"):
        check_engine(engine)
    del engine.blocks.free[seq.block_table[1]]
    check_engine(engine)
    engine.abort_request("r")
    engine.step()
    check_engine(engine)
