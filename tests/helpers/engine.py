"""Helpers for the engine-core tests (tests/test_engine_*.py): engines that the autouse
no-leak check in conftest.py watches, transformers references, and probes into a run
(logits per step, plans, preemptions)."""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import replace
from pathlib import Path

import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.coordinator.config import EngineConfig
from tapserve.coordinator.offline import LLM, GenerationResult
from tests.helpers.invariants import check_engine, watch_steps

# The transformers major version whose generate() semantics (beam search, padding) these
# tests were written against; see require_transformers_major().
TESTED_TRANSFORMERS_MAJOR = 5
TESTED_TRANSFORMERS_VERSION = "5.24"

_TRACKED: weakref.WeakSet[LLM] = weakref.WeakSet()


# ---- engines --------------------------------------------------------------------------------
def make_llm(model_dir: str | Path, **overrides) -> LLM:
    """An LLM on CPU in float32 with a fixed small KV cache, watched by the no-leak check."""
    kwargs = dict(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=256)
    kwargs.update(overrides)
    return track(LLM(EngineConfig(**kwargs)))


def track(llm: LLM) -> LLM:
    """Watch llm: the block-accounting invariants (tests/helpers/invariants.py) after every engine
    step, and the no-leak check after the test."""
    watch_steps(llm)
    _TRACKED.add(llm)
    return llm


def check_tracked_engines() -> None:
    """Every tracked engine is idle, every KV block is free again, the invariants hold.
    An engine found broken is reported once and then no longer watched, so one failure
    does not cascade into later tests."""
    problems = []
    for llm in list(_TRACKED):
        engine, blocks = llm.engine, llm.engine.blocks
        found = []
        if engine.has_work() or engine.requests:
            found.append(f"engine still has requests {sorted(engine.requests)}")
        elif blocks.num_free_blocks != blocks.num_blocks:
            found.append(f"KV blocks leaked: {blocks.num_free_blocks} free of {blocks.num_blocks}")
        else:
            try:
                engine.check_invariants()
                check_engine(engine)
            except AssertionError as e:
                found.append(f"engine invariants broken: {e}")
        if found:
            _TRACKED.discard(llm)
            problems += found
    assert not problems, "; ".join(problems)


def run(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    max_steps: int = 20_000,
) -> list[GenerationResult]:
    """Like llm.generate, but gives up (and fails) after max_steps engine steps instead of
    spinning forever when the engine stops making progress."""
    engine = llm.engine
    original = engine.step
    steps = 0

    def bounded_step():
        nonlocal steps
        steps += 1
        if steps > max_steps:
            for rid in list(engine.requests):
                engine.abort_request(rid)
            raise AssertionError(f"engine made no progress in {max_steps} steps")
        return original()

    engine.step = bounded_step
    try:
        results = llm.generate(prompts, params)
    finally:
        del engine.step
    for r in results:
        assert r.error_code is None, r.error_message
    return results


def greedy(max_new_tokens: int = 32, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def token_ids(results: list[GenerationResult]) -> list[list[int]]:
    """The first sequence's tokens of every result."""
    return [r.outputs[0].token_ids for r in results]


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


# ---- probes ---------------------------------------------------------------------------------
@contextlib.contextmanager
def capture_logits(llm: LLM):
    """Record every logits row the engine samples from:
    {(request_id, sequence index): [(position of the row's token, logits [vocab]), ...]}."""
    engine = llm.engine
    records: dict[tuple[str, int], list[tuple[int, torch.Tensor]]] = {}
    original = engine._postprocess

    def wrapper(batch, plan, rows, result):
        if result is not None and result.logits is not None:
            for i, seq in enumerate(rows.logit_seqs):
                key = (seq.request.request_id, seq.index)
                records.setdefault(key, []).append(
                    (seq.num_tokens - 1, result.logits[i].float().clone())
                )
        return original(batch, plan, rows, result)

    engine._postprocess = wrapper
    try:
        yield records
    finally:
        del engine._postprocess


@contextlib.contextmanager
def capture_plans(llm: LLM):
    """Record every StepPlan the engine runs."""
    runner = llm.runner
    plans = []
    original = runner.execute

    def wrapper(plan, *args, **kwargs):
        plans.append(
            copy.deepcopy(replace(plan, wire=None))
        )  # a plan's arrays live until the next build
        return original(plan, *args, **kwargs)

    runner.execute = wrapper
    try:
        yield plans
    finally:
        del runner.execute


@contextlib.contextmanager
def count_preemptions(llm: LLM):
    """A list that gets one request id per preemption."""
    scheduler = llm.engine.scheduler
    preempted: list[str] = []
    original = scheduler._preempt

    def wrapper(victims, batch):
        preempted.append(victims[0].request.request_id)  # the preempted sequences
        return original(victims, batch)

    scheduler._preempt = wrapper
    try:
        yield preempted
    finally:
        del scheduler._preempt


# ---- transformers reference -----------------------------------------------------------------
def transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


def require_transformers_major() -> None:
    """Skip (with the reason) when the installed transformers is not the major version the
    reference semantics were pinned to."""
    import pytest
    import transformers

    if transformers_major() != TESTED_TRANSFORMERS_MAJOR:
        pytest.skip(
            f"reference tests are pinned to transformers {TESTED_TRANSFORMERS_VERSION}.x "
            f"(major {TESTED_TRANSFORMERS_MAJOR}); installed: {transformers.__version__}"
        )


def hf_model(model_dir: str | Path, disable_eos: bool = True):
    """The checkpoint in transformers, float32, eval. disable_eos: generate() runs to
    max_new_tokens (our ignore_eos=True)."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    if disable_eos:
        model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def hf_greedy(
    model, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs
) -> list[list[int]]:
    """transformers' greedy generate() on a left-padded batch; the new tokens of each prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs
    )
    return [row[width:].tolist() for row in out]


@torch.no_grad()
def hf_logits(model, token_ids_: list[int]) -> torch.Tensor:
    """[len, vocab] logits of transformers' forward over one unpadded sequence."""
    return model(torch.tensor([token_ids_])).logits[0].float()


def assert_logits_match(
    model, records: dict, results: list[GenerationResult], atol: float = 1e-4
) -> int:
    """Every recorded logits row equals transformers' logits at that position of the
    prompt + generated tokens. Returns the number of rows compared."""
    compared = 0
    by_id = {r.request_id: r for r in results}
    for (rid, index), rows in records.items():
        r = by_id[rid]
        full = r.prompt_token_ids + r.outputs[index].token_ids
        ref = hf_logits(model, full)
        for pos, row in rows:
            torch.testing.assert_close(
                row, ref[pos], atol=atol, rtol=0, msg=lambda m: f"request {rid} position {pos}: {m}"
            )
            compared += 1
    return compared
