"""The KV cache takes what the GPU has left after a profile of the largest step; the profile's
steps must be ones the model runs correctly and at least as large as any step the scheduler
makes (an outside reviewer found a profile of one max_model_len sequence, 4x under the token
budget of a real step, and one logit row where a step may have max_num_seqs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.coordinator.config import EngineConfig
from tapserve.coordinator.offline import LLM
from tapserve.ranks.runner import _prefill_plan, profile_plans
from tests.helpers.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3")
    return LLM(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cpu",
            max_num_seqs=256,
            max_model_len=64,
            max_num_batched_tokens=512,
            custom_module=None,
        )
    )


def test_a_profile_step_is_a_well_formed_prefill(llm):
    """Three sequences in one step give the logits each gives alone (distinct slots, tables
    and logit rows)."""
    runner, lengths = llm.runner, [5, 17, 3]
    torch.manual_seed(0)
    ids = [torch.randint(0, 500, (n,)).numpy() for n in lengths]
    together = _prefill_plan(lengths, runner.cfg.block_size)
    together.input_ids[:] = np.concatenate(ids)
    caches = runner._allocate_kv_cache(int(together.block_tables.max()) + 1)
    logits = runner.execute(together, caches).logits
    for i, seq in enumerate(ids):
        alone = _prefill_plan([len(seq)], runner.cfg.block_size)
        alone.input_ids[:] = seq
        expected = runner.execute(alone, runner._allocate_kv_cache(4)).logits[0]
        torch.testing.assert_close(logits[i], expected, rtol=1e-5, atol=1e-5)


def test_the_profile_covers_the_largest_scheduled_step(llm):
    engine = llm.engine
    for i in range(9):
        engine.add_request(f"r{i}", [7 + i] * 60, SamplingParams(max_new_tokens=1))
    batch = engine.scheduler.schedule()
    tokens, rows = sum(batch.num_new_tokens), len(batch.seqs)
    cfg = llm.runner.cfg
    plans = profile_plans(
        cfg.max_num_batched_tokens, cfg.max_model_len, cfg.max_num_seqs, cfg.block_size
    )
    assert tokens > cfg.max_model_len  # the step the old profile (one sequence) fell short of
    assert tokens <= max(p.num_tokens for p in plans)
    assert rows <= max(p.logit_rows.size for p in plans)
    assert max(p.num_tokens for p in plans) == cfg.max_num_batched_tokens
    assert max(p.logit_rows.size for p in plans) == cfg.max_num_seqs
    assert max(int(p.context_lens.max()) for p in plans) == cfg.max_model_len
    for request_id in [f"r{i}" for i in range(9)]:
        engine.abort_request(request_id)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_step_takes_no_more_memory_than_the_profile(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    llm = LLM(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device="cuda",
            enforce_eager=True,
            max_num_seqs=256,
            max_model_len=64,
            max_num_batched_tokens=512,
            custom_module=None,
        )
    )
    runner, engine = llm.runner, llm.engine
    profiled = runner._profile_peak_activations()
    for i in range(8):
        engine.add_request(f"r{i}", [7 + i] * 60, SamplingParams(max_new_tokens=1))
    batch = engine.scheduler.schedule()
    plan, _ = engine.planner.build(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    runner.execute(plan)
    torch.cuda.synchronize()
    assert sum(batch.num_new_tokens) == 480
    assert torch.cuda.max_memory_allocated() - before <= profiled
