"""--max-num-seqs bounds every step's rows, forks included, and what the scheduler reports
after a preemption (found by an outside reviewer, 2026-12-01).

A request of n samples or of beams is admitted as its one prompt sequence and forks later; it
used to count as one row at admission, so its forks took batches past max_num_seqs (on CUDA
past the decode workspace: the step raised and the server ended), and a preempted beam
request wider than max_num_seqs was never admitted again (the queue behind it stalled)."""

from __future__ import annotations

import pytest

from tapserve.api.sampling_params import SamplingParams
from tapserve.api.wire import INVALID_PARAMS
from tapserve.coordinator.sequence import LAST_GENERATED, Request
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.engine import count_preemptions, greedy, make_llm, random_prompts
from tests.helpers.invariants import watch_steps

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("rows"), "qwen3")


def _record_rows(llm) -> list[int]:
    """The rows of every scheduled batch, appended as the engine schedules them."""
    rows: list[int] = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording():
        batch = schedule()
        rows.append(len(batch.seqs))
        return batch

    scheduler.schedule = recording
    return rows


def _sampled(**kwargs) -> SamplingParams:
    return SamplingParams(
        **{"max_new_tokens": 6, "temperature": 1.0, "seed": 3, "ignore_eos": True, **kwargs}
    )


def test_forks_never_take_a_step_past_max_num_seqs(ckpt):
    llm = watch_steps(make_llm(ckpt, max_num_seqs=4))
    rows = _record_rows(llm)
    prompts = random_prompts([5, 9, 3, 12, 7], VOCAB, seed=5)
    params = [
        _sampled(n=4),
        _sampled(n=3),
        _sampled(num_beams=2, n=2, temperature=0.0),
        greedy(6),
        _sampled(n=2),
    ]
    results = llm.generate(prompts, params)
    assert max(rows) <= 4, rows  # (was 9: each request admitted as one row)
    assert [len(r.outputs) for r in results] == [4, 3, 2, 1, 2]
    assert all(len(o.token_ids) == 6 for r in results for o in r.outputs)


def test_a_request_wider_than_max_num_seqs_is_605(ckpt):
    llm = make_llm(ckpt, max_num_seqs=2)
    prompt = random_prompts([6], VOCAB, seed=6)
    for params in (_sampled(n=3), _sampled(num_beams=3, n=1, temperature=0.0)):
        (result,) = llm.generate(prompt, params, raise_errors=False)
        assert result.error_code == INVALID_PARAMS, result
        assert "--max-num-seqs" in result.error_message
    (ok,) = llm.generate(prompt, _sampled(n=2))
    assert len(ok.outputs) == 2
    # beams that score their last tokens run a scoring fork per finished hypothesis too
    beams = Request("r", [1], SamplingParams(num_beams=3, n=1), 0, custom_position=LAST_GENERATED)
    assert beams.max_rows == 6 and Request("s", [1], _sampled(n=3), 0).max_rows == 3


def test_preempted_beams_are_admitted_again(ckpt):
    """A long greedy request and a beam request share a small cache: the beams are preempted
    and come back (with num_beams <= max_num_seqs), and the request queued behind them runs;
    the beams equal the same request run alone."""
    prompts = random_prompts([20, 20, 10], VOCAB, seed=7)
    beams = SamplingParams(max_new_tokens=30, num_beams=2, n=2, temperature=0.0, ignore_eos=True)
    alone = make_llm(ckpt).generate([prompts[1]], beams)[0]
    llm = watch_steps(make_llm(ckpt, num_kv_blocks=14, block_size=8, max_num_seqs=3))
    with count_preemptions(llm) as preempted:
        results = llm.generate(prompts, [greedy(90), beams, greedy(5)])
    assert preempted, "the cache was meant to force a preemption"
    assert [o.token_ids for o in results[1].outputs] == [o.token_ids for o in alone.outputs]
    assert len(results[2].outputs[0].token_ids) == 5


def test_cached_tokens_are_counted_at_the_first_admission(ckpt):
    """A request preempted mid-prefill finds its own computed blocks in the prefix cache when
    it comes back; those are not cached tokens of the request (it reported them)."""
    llm = make_llm(ckpt, num_kv_blocks=12, block_size=8, max_num_batched_tokens=5)
    first, second = random_prompts([8, 60], VOCAB, seed=4)
    engine = llm.engine
    engine.add_request("a", first, greedy(60))
    for _ in range(20):
        engine.step()
    engine.add_request("b", second, greedy(5))
    request = engine.requests["b"]
    with count_preemptions(llm) as preempted:
        while engine.has_work():
            engine.step()
    assert "b" in preempted and request.is_finished
    assert request.num_cached_tokens == 0


def test_beams_scoring_their_tokens_beside_a_chunked_prefill(tmp_path):
    """Beams that score their last tokens (LAST_GENERATED) fork a scorer per finished
    hypothesis; a long prefill chunk ahead of those forks in the running list took the token
    budget, the forks waited, the beams finished more hypotheses and forked again: a step of
    10 rows with max_num_seqs 8 (found by an outside reviewer; on CUDA the step raised). Now
    the beams advance only in a step that also scores their pending forks."""
    import random

    from tapserve.model.custom_output import CustomOutputHandler
    from tests.helpers.custom import VOCAB as HEAD_VOCAB
    from tests.helpers.custom import make_head_checkpoint, prompt
    from tests.helpers.custom import make_llm as make_head_llm

    llm = watch_steps(
        make_head_llm(
            make_head_checkpoint(tmp_path / "ckpt"),
            max_num_seqs=8,
            max_num_batched_tokens=16,
            num_kv_blocks=40,
        )
    )
    rows = _record_rows(llm)
    engine, rnd = llm.engine, random.Random(37)
    last = {"position": CustomOutputHandler.LAST_GENERATED}
    stops = rnd.sample(range(4, HEAD_VOCAB), 150)  # hypotheses finish often
    engine.add_request(
        "beams",
        prompt(7, 37),
        SamplingParams(max_new_tokens=12, temperature=0.0, num_beams=2, n=1, stop_token_ids=stops),
        last,
    )
    for i in range(8):
        engine.add_request(
            f"s{i}",
            prompt(rnd.randint(20, 120), 470 + i),
            greedy(rnd.randint(2, 10)),
            last if i % 2 else None,
        )
    while engine.has_work():
        engine.step()
    assert max(rows) <= 8, rows
