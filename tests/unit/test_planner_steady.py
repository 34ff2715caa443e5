"""The planner's steady decode plans (Planner._advance): the last decode plan, laid out in its
wire message (PlanMessage), advanced in place by a token per row.

A real Scheduler and BlockManager decode a batch of staggered prompts with a small block size
(tables grow and the longest one widens every few steps); after each step every row gains a
token and the scheduler hears it (note_advanced), as from the engine. Every plan is checked
against the sequences and the general builder, and its message against the plan
(tests/helpers/invariants.py check_plan), through finishes that break the steady run and through the
planner's fallbacks.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tapserve.api.sampling_params import SamplingParams
from tapserve.coordinator.blocks import BlockManager
from tapserve.coordinator.planner import Planner
from tapserve.coordinator.scheduled_batch import ScheduledBatch
from tapserve.coordinator.scheduler import Scheduler, SchedulerConfig
from tapserve.coordinator.sequence import Request, SequenceFactory
from tapserve.ranks.plan import PlanMessage, StepKind
from tests.helpers.invariants import check_plan

BLOCK = 4


def _decoding(num_seqs: int, seed: int) -> Scheduler:
    rng = random.Random(seed)
    blocks = BlockManager(num_seqs * 40, BLOCK)
    scheduler = Scheduler(SchedulerConfig(num_seqs, 1 << 20), blocks)
    factory = SequenceFactory()
    for i in range(num_seqs):
        prompt = [rng.randrange(1000) for _ in range(5 + 3 * i)]
        request = Request(str(i), prompt, SamplingParams(max_new_tokens=100), i)
        request.single = True  # as Engine.add_request sets for n = 1 without beams
        factory.prompt_sequence(request)
        scheduler.add(request)
    return scheduler


def _advance(
    scheduler: Scheduler, batch: ScheduledBatch, rng: random.Random, report: bool = True
) -> None:
    """What Engine._postprocess leaves: computed KV, full blocks cached, a token appended."""
    tokens = []
    for seq, context_len in zip(batch.seqs, batch.context_lens):
        filled = context_len // BLOCK != seq.num_computed_tokens // BLOCK
        seq.num_computed_tokens = context_len
        if filled:
            scheduler.blocks.register_computed(seq)
        tokens.append(rng.randrange(1000))
        seq.token_ids.append(tokens[-1])
    if report and batch.num_new_tokens.count(1) == len(batch.seqs):
        scheduler.note_advanced(batch, tokens)


def _planner(**kwargs) -> Planner:
    """A planner with the table dtype an engine picks for these small pools."""
    return Planner(BLOCK, table_dtype=np.dtype(np.uint16), **kwargs)


def _run(steps: int, seed: int, planner: Planner, finish_every: int = 0) -> int:
    """Decode for `steps` steps, checking every plan; returns how many were advanced in place."""
    rng = random.Random(seed)
    scheduler = _decoding(12, seed)
    advanced, last_wire = 0, None
    for step in range(steps):
        batch = scheduler.schedule()
        plan, rows = planner.build(batch)
        check_plan(batch, plan, rows, BLOCK, scheduler.blocks)
        assert plan.block_tables.shape[1] <= (planner.max_table_width or 1 << 30)
        if batch.follows >= 0 and plan.wire is last_wire:
            advanced += 1
        last_wire = plan.wire
        _advance(scheduler, batch, rng)
        if finish_every and step % finish_every == finish_every - 1 and scheduler.running:
            scheduler.remove(scheduler.running[rng.randrange(len(scheduler.running))])
    return advanced


@pytest.mark.parametrize("width_step", [1, 16])
def test_steady_plans_equal_the_general_builder_while_tables_widen(width_step):
    """Width step 1: the message widens whenever the longest table grows."""
    planner = _planner(width_step=width_step)
    advanced = _run(60, seed=0, planner=planner)
    assert advanced >= 50  # all but the prefill and the first decode step, and the rare re-lay


def test_padded_tables_stay_within_the_widest_table_allowed():
    """The longest prompt (38 tokens) and 60 decode steps fill 25 blocks of 4: padding to 32
    columns would pass the limit."""
    assert _run(60, seed=4, planner=_planner(max_table_width=25)) >= 50


def test_finishes_break_the_run_and_the_next_plan_is_built_anew():
    assert _run(80, seed=1, planner=_planner(width_step=1), finish_every=7) >= 40


def test_a_message_without_room_to_widen_is_laid_out_anew(monkeypatch):
    monkeypatch.setattr(PlanMessage, "widen", lambda self, width: False)
    assert _run(40, seed=2, planner=_planner(width_step=1)) >= 10


def test_a_table_with_a_spare_block_keeps_its_steps_general():
    """The planner's in-place advance relies on every table holding exactly the blocks of
    its tokens (a row then writes into a new block exactly when it grows): a batch where a
    table holds one more is scheduled by the general pass until its tokens fill it."""
    scheduler = _decoding(6, seed=3)
    planner, rng = _planner(), random.Random(3)
    follows = []
    for step in range(24):
        batch = scheduler.schedule()
        plan, rows = planner.build(batch)
        check_plan(batch, plan, rows, BLOCK, scheduler.blocks)
        follows.append(batch.follows >= 0)
        _advance(scheduler, batch, rng, report=step != 3)
        if step == 3:  # a spare block (no allocation makes one), outside a steady run
            seq = scheduler.running[2]
            seq.block_table.append(scheduler.blocks._take_fresh())
            scheduler.blocks._restamp(seq, appended=True)
    # the spare block is in use from the 4th step after (its row at 18 of 20 slots)
    assert all(follows[2:4]) and not any(follows[4:7]) and all(follows[7:])


def test_a_widened_message_decodes_to_its_plan():
    rng = np.random.default_rng(0)
    from tapserve.ranks.plan import StepPlan

    plan = StepPlan(
        StepKind.DECODE,
        input_ids=rng.integers(0, 99, 5),
        positions=np.arange(5),
        slot_mapping=np.arange(5) * 3,
        query_start_loc=np.arange(6, dtype=np.int32),
        context_lens=np.arange(1, 6, dtype=np.int32),
        block_tables=rng.integers(1, 50, (5, 3)).astype(np.int32),
        logit_rows=np.arange(5),
    )
    message = PlanMessage(plan)
    before = message.views[-1].copy()
    assert message.widen(7)
    laid = message.plan(StepKind.DECODE, graph_bucket=4)
    assert laid.block_tables.shape == (5, 7)
    assert np.array_equal(laid.block_tables[:, :3], before) and not laid.block_tables[:, 3:].any()
    from tests.helpers.invariants import check_wire

    check_wire(laid)
    laid.block_tables = laid.block_tables.copy()  # an array swapped out: not the message's
    assert not message.holds(laid)
