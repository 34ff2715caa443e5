"""Scheduler.schedule_ahead on its own: the next decode step of a batch whose tokens are still
being sampled (coordinator/run_ahead.py), scheduled from the scheduler's arrays, with the
rows that finished meanwhile dropped; and None, with no block taken and no sequence
touched, whenever the general pass is needed."""

from __future__ import annotations

import random

import numpy as np

from tapserve.api.sampling_params import SamplingParams
from tapserve.coordinator.blocks import BlockManager
from tapserve.coordinator.scheduled_batch import ScheduledBatch
from tapserve.coordinator.scheduler import Scheduler, SchedulerConfig
from tapserve.coordinator.sequence import Request, SeqStatus, SequenceFactory

BLOCK = 4


def _decoding(num_seqs: int, num_blocks: int = 400, max_num_seqs: int = 16) -> Scheduler:
    """A scheduler whose prompts (of staggered lengths) were prefilled and sampled once."""
    rng = random.Random(0)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs, 1 << 20), BlockManager(num_blocks, BLOCK))
    factory = SequenceFactory()
    for i in range(num_seqs):
        request = Request(
            str(i),
            [rng.randrange(1000) for _ in range(5 + 3 * i)],
            SamplingParams(max_new_tokens=100),
            i,
        )
        request.single = True
        factory.prompt_sequence(request)
        scheduler.add(request)
    _finish_step(scheduler, scheduler.schedule())  # the prefill and its first token
    return scheduler


def _finish_step(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    """The host work of a step (Engine._finish_ahead): computed counts, a token appended."""
    for seq, context_len in zip(batch.seqs, batch.context_lens):
        seq.num_computed_tokens = context_len
        seq.token_ids.append(7)


def _launch(scheduler: Scheduler) -> ScheduledBatch:
    """A general decode step, noted as running ahead (its tokens on the device)."""
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [1] * len(batch.seqs)
    scheduler.note_advanced(batch, None)
    return batch


def _late(prompt: list[int]) -> Request:
    """A request arriving with its prompt sequence, as the engine adds one."""
    request = Request("late", prompt, SamplingParams(max_new_tokens=4), 99)
    request.single = True
    SequenceFactory().prompt_sequence(request)
    return request


def _state(scheduler: Scheduler):
    return (
        scheduler.blocks.num_free_blocks,
        [(list(s.block_table), s.block_table_version) for s in scheduler.running],
    )


def test_the_next_step_is_one_token_further_before_the_tokens_are_home():
    scheduler = _decoding(6)
    for _ in range(9):  # tables outgrow their blocks along the way (block size 4)
        batch = _launch(scheduler)
        ahead, keep = scheduler.schedule_ahead()
        assert keep is None and ahead.follows == batch.serial and ahead.last_token_ids is None
        assert ahead.seqs == batch.seqs
        assert ahead.context_lens == [c + 1 for c in batch.context_lens]
        for seq, context_len in zip(ahead.seqs, ahead.context_lens):
            # the row's new position has a block, and no block beyond it
            assert len(seq.block_table) == -(-context_len // BLOCK)
        _finish_step(scheduler, batch)
        _finish_step(scheduler, ahead)


def test_rows_finished_meanwhile_are_dropped():
    scheduler = _decoding(6)
    batch = _launch(scheduler)
    for i in (1, 4):
        seq = batch.seqs[i]
        seq.status = SeqStatus.FINISHED
        scheduler.remove(seq)
    ahead, keep = scheduler.schedule_ahead()
    assert keep.tolist() == [0, 2, 3, 5] and keep.dtype == np.int64
    assert ahead.seqs == [batch.seqs[i] for i in (0, 2, 3, 5)]
    assert ahead.context_lens == [batch.context_lens[i] + 1 for i in (0, 2, 3, 5)]
    assert ahead.follows == -1  # other rows than the last plan's: the planner builds anew


def test_the_general_pass_is_left_to_the_caller_untouched():
    # a request waiting with room to admit it
    scheduler = _decoding(4)
    _launch(scheduler)
    scheduler.add(_late([1, 2, 3]))
    before = _state(scheduler)
    assert scheduler.schedule_ahead() is None
    assert _state(scheduler) == before
    # a batch noted with its tokens (a synchronous step): not one to schedule ahead
    scheduler = _decoding(4)
    batch = scheduler.schedule()
    scheduler.note_advanced(batch, [5] * len(batch.seqs))
    assert scheduler.schedule_ahead() is None
    # blocks running short for the rows that grow: the general pass may preempt
    scheduler = _decoding(4, num_blocks=40)
    while True:
        batch = _launch(scheduler)
        grows = sum(
            c + 1 > len(s.block_table) * BLOCK for s, c in zip(batch.seqs, batch.context_lens)
        )
        if grows > scheduler.blocks.num_free_blocks:
            break
        ahead, _ = scheduler.schedule_ahead()
        _finish_step(scheduler, batch)
        _finish_step(scheduler, ahead)
    before = _state(scheduler)
    assert scheduler.schedule_ahead() is None
    assert _state(scheduler) == before


def test_a_full_batch_keeps_running_ahead_past_a_waiting_request():
    """No room to admit (max_num_seqs reached): the waiting request does not stop it."""
    scheduler = _decoding(4, max_num_seqs=4)
    _launch(scheduler)
    scheduler.add(_late([1, 2, 3]))
    assert scheduler.schedule_ahead() is not None


def test_a_request_whose_blocks_do_not_fit_waits_while_the_batch_runs_ahead():
    """Room in max_num_seqs but not in the cache: running ahead goes on; once rows finish
    and free their blocks, it stops (None) and the general pass admits the request."""
    scheduler = _decoding(4, num_blocks=40)
    batch = _launch(scheduler)
    free = scheduler.blocks.num_free_blocks
    late = _late(list(range(BLOCK * (free + 1))))
    scheduler.add(late)
    ahead, _ = scheduler.schedule_ahead()  # the general pass could not admit it either
    _finish_step(scheduler, batch)
    _finish_step(scheduler, ahead)
    scheduler.note_advanced(ahead, None)
    for seq in list(scheduler.running)[:3]:  # three rows finish, their blocks come back
        seq.status = SeqStatus.FINISHED
        scheduler.remove(seq)
    assert scheduler.schedule_ahead() is None
    admitted = scheduler.schedule()
    assert late.sequences[0] in admitted.seqs


def test_no_token_budget_left_for_a_new_request_does_not_drain():
    """The running rows use the whole token budget (max_num_batched_tokens below
    max_num_seqs): the general pass could not admit the waiting request, so running ahead
    goes on."""
    scheduler = _decoding(4)
    scheduler.config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4)
    _launch(scheduler)
    scheduler.add(_late([1, 2, 3]))
    assert scheduler.schedule_ahead() is not None
    scheduler.config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=5)
    assert scheduler.schedule_ahead() is None  # one token left: the general pass admits it
