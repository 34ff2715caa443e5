"""Steady decode steps: the scheduler plans a step of the same running sequences from arrays
carried over from the last step (Scheduler.note_advanced) instead of reading each sequence.

Every plan these engines build is also checked row by row against the sequences and the
general builder (tests/helpers/invariants.py, check_plan), so a wrong token, stamp or length from the
steady path fails there; the tests below make sure the steady path really runs, and that the
tokens are those of the general path through finishes, preemption and aborts.
"""

from __future__ import annotations

import pytest

from tapserve.api.sampling_params import SamplingParams
from tests.helpers.engine import count_preemptions, make_llm, random_prompts, run


@pytest.fixture(scope="module")
def demo_dir():
    from tapserve.model.demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint()


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def _record_batches(engine) -> list[list[str]]:
    """The request ids of every batch the engine plans from now on."""
    scheduled: list[list[str]] = []
    build = engine.planner.build

    def recording_build(batch):
        scheduled.append([s.request.request_id for s in batch.seqs])
        return build(batch)

    engine.planner.build = recording_build
    return scheduled


def test_steady_steps_give_the_tokens_of_each_request_alone(demo_dir):
    """A batch whose sequences finish one by one (different lengths), each step between
    finishes a steady one, against each request run alone (max_num_seqs 1)."""
    prompts = random_prompts([20, 35, 17, 48], 1000, seed=3)
    params = [greedy(24 + 9 * i) for i in range(len(prompts))]
    llm = make_llm(demo_dir, num_kv_blocks=64, max_model_len=256)
    batched = run(llm, prompts, params)
    steady = llm.engine.scheduler.num_steady_steps
    assert steady > 0.7 * llm.engine.steps_checked, (steady, llm.engine.steps_checked)
    alone = make_llm(demo_dir, num_kv_blocks=64, max_model_len=256, max_num_seqs=1)
    for prompt, p, got in zip(prompts, params, batched):
        assert got.outputs[0].token_ids == run(alone, [prompt], p)[0].outputs[0].token_ids


def test_blocks_running_short_take_the_general_pass(demo_dir):
    """Under a KV cache too small for the batch, the steady path hands a step that would need
    to preempt to the general pass; the tokens are those of a roomy cache."""
    prompts = random_prompts([30, 26, 33, 21, 40], 1000, seed=4)
    tiny = make_llm(demo_dir, num_kv_blocks=12, block_size=16, max_model_len=160)
    with count_preemptions(tiny) as preempted:
        got = run(tiny, prompts, greedy(60))
    assert preempted, "the tiny cache was meant to force preemption"
    assert tiny.engine.scheduler.num_steady_steps > 0
    roomy = make_llm(demo_dir, num_kv_blocks=128, block_size=16, max_model_len=160)
    want = run(roomy, prompts, greedy(60))
    assert [r.outputs[0].token_ids for r in got] == [r.outputs[0].token_ids for r in want]


def test_an_abort_between_steady_steps_leaves_the_next_step(demo_dir):
    llm = make_llm(demo_dir, num_kv_blocks=64, max_model_len=256)
    engine = llm.engine
    for i, prompt in enumerate(random_prompts([18, 22, 27], 1000, seed=5)):
        engine.add_request(f"r{i}", prompt, greedy(30))
    for _ in range(4):
        engine.step()
    before = engine.scheduler.num_steady_steps
    engine.step()
    assert engine.scheduler.num_steady_steps == before + 1, "a steady step was expected"
    scheduled = _record_batches(engine)
    engine.abort_request("r1")
    engine.step()  # the running set changed: the general pass
    engine.step()  # steady again, without r1
    assert scheduled == [["r0", "r2"], ["r0", "r2"]]
    assert engine.scheduler.num_steady_steps == before + 2
    for rid in ("r0", "r2"):
        engine.abort_request(rid)
    while engine.has_work():
        engine.step()


def test_a_request_arriving_during_steady_steps_is_admitted_next_step(demo_dir):
    llm = make_llm(demo_dir, num_kv_blocks=64, max_model_len=256)
    engine = llm.engine
    prompts = random_prompts([18, 22, 9], 1000, seed=7)
    for i in range(2):
        engine.add_request(f"r{i}", prompts[i], greedy(30))
    for _ in range(5):
        engine.step()
    assert engine.scheduler.num_steady_steps > 0
    scheduled = _record_batches(engine)
    engine.add_request("late", prompts[2], greedy(5))
    engine.step()
    assert scheduled == [["r0", "r1", "late"]]
    while engine.has_work():
        engine.step()


def test_steady_steps_run_while_the_queue_waits_for_a_free_seat(demo_dir):
    """max_num_seqs 2, four requests: the two waiting cannot be admitted while two run, so
    those steps may be steady; the waiting ones start as seats free up."""
    llm = make_llm(demo_dir, num_kv_blocks=64, max_model_len=256, max_num_seqs=2)
    scheduler = llm.engine.scheduler
    steady_while_waiting = []
    schedule_steady = scheduler._schedule_steady

    def recording(steady):
        batch = schedule_steady(steady)
        steady_while_waiting.append(batch is not None and bool(scheduler.waiting))
        return batch

    scheduler._schedule_steady = recording
    prompts = random_prompts([18, 22, 9, 14], 1000, seed=8)
    results = run(llm, prompts, [greedy(12 + 6 * i) for i in range(4)])
    assert [len(r.outputs[0].token_ids) for r in results] == [12, 18, 24, 30]
    assert sum(steady_while_waiting) >= 10, steady_while_waiting


def _output_stream(engine, prompts, params) -> list[list[tuple]]:
    """Every step's outputs, expanded (columns included), as comparable tuples."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    steps = []
    while engine.has_work():
        steps.append(
            sorted(
                (
                    o.request_id,
                    o.finished,
                    tuple((s.index, tuple(s.new_token_ids), s.finish_reason) for s in o.sequences),
                )
                for o in engine.step()
            )
        )
    return steps


def test_steady_steps_put_their_news_in_the_columns_as_the_general_pass(demo_dir, monkeypatch):
    """SteadyColumns' shortcut (same rows, one sampled token each) gives the step outputs of
    put_news_in_columns, step for step, through first tokens and finishes."""
    from tapserve.coordinator import outputs as outputs_module

    prompts = random_prompts([18, 30, 11, 25], 1000, seed=9)
    params = [greedy(10 + 7 * i) for i in range(4)]
    general_steps = []
    put = outputs_module.put_news_in_columns
    monkeypatch.setattr(
        outputs_module,
        "put_news_in_columns",
        lambda seqs, outputs: general_steps.append(1) or put(seqs, outputs),
    )
    got = _output_stream(
        make_llm(demo_dir, num_kv_blocks=64, max_model_len=256).engine, prompts, params
    )
    assert len(general_steps) < 0.5 * len(got), (len(general_steps), len(got))  # shortcuts
    monkeypatch.setattr(
        outputs_module.SteadyColumns,
        "put",
        lambda self, batch, tokens, outputs: put(batch.seqs, outputs)[0],
    )
    assert got == _output_stream(
        make_llm(demo_dir, num_kv_blocks=64, max_model_len=256).engine, prompts, params
    )
