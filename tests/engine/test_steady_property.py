"""Random schedules through the steady decode path (Scheduler.note_advanced, Planner._advance)
and through the general pass alone: the same arrivals, lengths, max_new_tokens, n and aborts
at the same steps give the same plan at every step and the same outputs.

Both engines are watched (tests/helpers/invariants.py: every plan checked row by row against
the sequences, the block accounting after every step, no block leaked at the end).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tapserve.api.sampling_params import SamplingParams
from tapserve.ranks.plan import StepPlan
from tests.helpers.engine import capture_plans, make_llm


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt_len: int
    max_new_tokens: int
    n: int
    temperature: float


@dataclass(frozen=True)
class Abort:
    step: int
    which: int  # the arrival's index, modulo the requests added so far


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 30),
    prompt_len=st.integers(1, 40),
    max_new_tokens=st.integers(1, 40),
    n=st.sampled_from([1, 1, 1, 2]),
    temperature=st.sampled_from([0.0, 0.0, 0.8]),
)
aborts = st.builds(Abort, step=st.integers(1, 40), which=st.integers(0, 20))
schedules = st.tuples(
    st.lists(arrivals, min_size=1, max_size=8),
    st.lists(aborts, max_size=3),
    st.integers(0, 2**16),
)

CONFIG = dict(
    num_kv_blocks=20, block_size=8, max_num_seqs=5, max_num_batched_tokens=48, max_model_len=96
)


def _drive(llm, arrivals_: list[Arrival], aborts_: list[Abort], seed: int) -> list:
    """Apply the schedule step by step; every step's outputs, in order."""
    engine, rng = llm.engine, random.Random(seed)
    added: list[str] = []
    steps: list = []
    step = 0
    last_event = max(e.step for e in [*arrivals_, *aborts_])
    while step <= last_event or engine.has_work():
        for i, a in enumerate(arrivals_):
            if a.step == step:
                prompt = [rng.randrange(1000) for _ in range(a.prompt_len)]
                params = SamplingParams(
                    max_new_tokens=a.max_new_tokens, n=a.n, temperature=a.temperature
                )
                engine.add_request(f"r{i}", prompt, params)
                added.append(f"r{i}")
        for a in aborts_:
            if a.step == step and added:
                engine.abort_request(added[a.which % len(added)])
        if engine.has_work():
            steps.append(engine.step())
        step += 1
        assert step < 2000, "the engine made no progress"
    return steps


def _drain(llm) -> None:
    engine = llm.engine
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_work():
        engine.step()


def _plan_fields(plan: StepPlan) -> dict:
    return {
        name: (value.dtype.str, value.shape, value.tolist())
        if isinstance(value, np.ndarray)
        else value
        for name, value in vars(plan).items()
        if name != "wire"
    }


def test_random_schedules_plan_and_output_alike_with_and_without_the_steady_path():
    from tapserve.model.demo import ensure_demo_checkpoint

    demo_dir = ensure_demo_checkpoint()
    steady_steps: list[int] = []

    @settings(max_examples=25, deadline=None, database=None, derandomize=True)
    @given(schedules)
    def check(schedule):
        arrivals_, aborts_, seed = schedule
        steady = make_llm(demo_dir, seed=3, **CONFIG)
        general = make_llm(demo_dir, seed=3, **CONFIG)
        general.engine.scheduler.note_advanced = lambda batch, tokens: None  # no steady step
        try:
            with capture_plans(steady) as steady_plans, capture_plans(general) as general_plans:
                want = _drive(general, arrivals_, aborts_, seed)
                got = _drive(steady, arrivals_, aborts_, seed)
        finally:  # a failing example leaves no request behind for the no-leak check
            _drain(general)
            _drain(steady)
        assert general.engine.scheduler.num_steady_steps == 0
        assert len(steady_plans) == len(general_plans)
        for i, (a, b) in enumerate(zip(steady_plans, general_plans)):
            assert _plan_fields(a) == _plan_fields(b), f"plan {i}"
        assert got == want
        steady_steps.append(steady.engine.scheduler.num_steady_steps)

    check()
    assert sum(steady_steps) > 100, steady_steps  # the steady path did run
