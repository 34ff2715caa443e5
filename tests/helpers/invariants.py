"""The complete block-accounting invariant of a live engine, and a per-step watch (test only).

`check_engine(engine)` checks, at any point between steps:

- partition: every block is exactly one of used (ref_count > 0), cached (ref_count 0, still
  registered in the prefix cache) or free (ref_count 0, no cache entry):
  free + used + cached == total, and the allocator's free list is exactly cached + free;
- reference counts: each block's ref_count equals the number of references to it from the
  block tables of live sequences (of requests the engine still holds); finished and
  waiting (preempted) sequences hold no block; no table names a block twice;
- the prefix cache maps each hash to a block carrying that hash, one block per hash;
- scheduler: every running sequence is live, RUNNING, of a request the engine holds, and
  listed once; its computed tokens fit its blocks; no more run than max_num_seqs.

`check_plan(batch, plan, rows, block_size, blocks)` checks a freshly built step plan against
the sequences themselves: the scheduler's per-row records (newest token, table stamp, context
length, block capacity) and flags (special rows, partial, all single) agree with the
sequences, no row writes a shared block, and every array of the plan equals what the general
token-by-token builder makes from the sequences, with block tables rebuilt from each
sequence's own table; a plan laid out in its wire message decodes from it unchanged.

`watch_steps(llm_or_engine)` makes the engine run `check_engine` after every `step()`, and
`check_plan` on every plan it builds. It swaps the instances' classes for subclasses (no cost
in production: only tests call it), so helpers that patch `engine.step` on the instance and
`del` it later keep working.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from tapserve.coordinator.blocks import BlockManager
from tapserve.coordinator.engine import Engine
from tapserve.coordinator.planner import PlanRows, _mixed_plan
from tapserve.coordinator.scheduled_batch import ScheduledBatch
from tapserve.coordinator.sequence import SeqStatus
from tapserve.ranks.plan import (
    _ARRAY_FIELDS,
    TRANSPORT_HEADER_BYTES,
    StepKind,
    StepPlan,
    block_table_dtype,
    decode_plan,
)


def block_counts(engine: Engine) -> dict[str, int]:
    bm = engine.blocks
    cached_ids = set(bm.cached.values())
    used = sum(1 for b in bm.blocks if b.ref_count > 0)
    cached = sum(1 for b in bm.blocks if b.ref_count == 0 and b.block_id in cached_ids)
    free = sum(1 for b in bm.blocks if b.ref_count == 0 and b.block_id not in cached_ids)
    return {"free": free, "used": used, "cached": cached, "total": bm.num_blocks}


def check_engine(engine: Engine) -> None:
    bm = engine.blocks
    n = bm.num_blocks
    assert len(bm.blocks) == n and all(b.block_id == i for i, b in enumerate(bm.blocks))

    # partition: free + used + cached == total
    counts = block_counts(engine)
    assert counts["free"] + counts["used"] + counts["cached"] == n, counts
    assert all(b.ref_count >= 0 for b in bm.blocks), "negative ref count"
    zero = {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert set(bm.free) == zero, (
        f"free list != blocks with ref 0: only listed "
        f"{sorted(set(bm.free) - zero)[:8]}, missing "
        f"{sorted(zero - set(bm.free))[:8]}"
    )
    assert len(bm.free) == counts["free"] + counts["cached"]

    # prefix cache: hash -> a block carrying that hash, one block per hash
    assert len(set(bm.cached.values())) == len(bm.cached), "a block is cached under two hashes"
    for h, block_id in bm.cached.items():
        assert 0 <= block_id < n and bm.blocks[block_id].hash == h, f"cache entry {h} -> {block_id}"
        assert len(bm.blocks[block_id].token_ids) == bm.block_size, (
            f"cached block {block_id} not full"
        )

    # reference counts == references from live sequences' block tables
    refs: Counter[int] = Counter()
    for rid, request in engine.requests.items():
        assert request.request_id == rid
        for seq in request.sequences:
            table = seq.block_table
            if seq.is_finished or seq.status is SeqStatus.WAITING:
                assert not table, (
                    f"{seq.status.value} sequence {rid}/{seq.index} still holds blocks {table}"
                )
                continue
            assert len(set(table)) == len(table), f"{rid}/{seq.index} names a block twice: {table}"
            assert all(0 <= b < n for b in table), f"{rid}/{seq.index}: block id out of range"
            assert seq.num_computed_tokens <= len(table) * bm.block_size, (
                f"{rid}/{seq.index}: {seq.num_computed_tokens} computed tokens in {len(table)} blocks"
            )
            refs.update(table)
    wrong = [
        (b.block_id, b.ref_count, refs.get(b.block_id, 0))
        for b in bm.blocks
        if b.ref_count != refs.get(b.block_id, 0)
    ]
    assert not wrong, f"(block, ref_count, live references) mismatch: {wrong[:8]}"

    # scheduler state
    running = engine.scheduler.running
    assert len(set(map(id, running))) == len(running), "a sequence is running twice"
    limit = engine.scheduler.config.max_num_seqs  # forks included: the workspace's rows
    assert len(running) <= limit, f"{len(running)} running sequences, max_num_seqs {limit}"
    for seq in running:
        rid = seq.request.request_id
        assert engine.requests.get(rid) is seq.request, f"running sequence of unknown request {rid}"
        assert seq.status is SeqStatus.RUNNING, f"{rid}/{seq.index} in running with {seq.status}"
    live_running = {
        id(s)
        for r in engine.requests.values()
        for s in r.sequences
        if s.status is SeqStatus.RUNNING
    }
    assert live_running == set(map(id, running)), "RUNNING sequences missing from the scheduler"
    for request in engine.scheduler.waiting:
        assert engine.requests.get(request.request_id) is request, (
            f"waiting request {request.request_id} unknown to the engine"
        )


def check_plan(
    batch: ScheduledBatch,
    plan: StepPlan,
    rows: PlanRows,
    block_size: int,
    blocks: BlockManager | None = None,
) -> None:
    seqs = batch.seqs
    if batch.last_token_ids is None:
        check_ahead_plan(batch, plan, rows, block_size)
        return
    assert batch.last_token_ids == [s.token_ids[-1] for s in seqs], "newest tokens"
    assert not plan.ids_from_rank0, "a plan with its ids says they come from rank 0's device"
    assert batch.table_stamps == [s.block_table_version for s in seqs], "table stamps"
    special = any(
        s.scoring_reason is not None or s.num_computed_tokens < s.num_prompt_tokens for s in seqs
    )
    assert batch.has_special_rows == special, f"has_special_rows {batch.has_special_rows}"
    for s, n, c in zip(seqs, batch.num_new_tokens, batch.context_lens):
        assert c == s.num_computed_tokens + n, "context length != computed + new tokens"
        assert batch.partial or c == s.num_tokens, "a row leaves tokens uncomputed, partial unset"
    # one way: the beam branch may clear it with no beam row scheduled
    assert not batch.all_single or all(s.request.single for s in seqs), "all_single"
    if batch.block_capacities is not None:
        assert batch.block_capacities.tolist() == [len(s.block_table) * block_size for s in seqs], (
            "block capacities"
        )
    if blocks is not None:  # every block a row writes is its own (copies on write are done)
        for s, n, c in zip(seqs, batch.num_new_tokens, batch.context_lens):
            for b in {s.block_table[p // block_size] for p in range(c - n, c)}:
                assert blocks.blocks[b].ref_count == 1, f"a row writes into shared block {b}"
    width = max((len(s.block_table) for s in seqs), default=0)
    # the pool's table dtype where the pool is known (ranks.plan.block_table_dtype)
    dtype = plan.block_tables.dtype if blocks is None else block_table_dtype(blocks.num_blocks)
    tables = np.zeros((len(seqs), width), dtype)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = s.block_table
    want, want_rows = _mixed_plan(
        batch, plan.kind, block_size, tables, np.asarray(batch.context_lens, np.int32)
    )
    # a plain decode plan's ALL_GENERATED rows are not in plan.custom_rows but rows.generated
    handler_rows = sorted(
        zip(
            np.concatenate([plan.custom_rows, rows.generated]).tolist(),
            [
                *rows.custom_seqs,
                *rows.generated_seqs,
            ],
        ),
        key=lambda pair: pair[0],
    )
    for name in _ARRAY_FIELDS:
        got, ref = getattr(plan, name), getattr(want, name)
        if name == "custom_rows":
            got = np.array([i for i, _ in handler_rows], np.int64)
        if name == "block_tables":  # may be zero-padded (advanced plans)
            assert got.shape[1] >= ref.shape[1] and not got[:, ref.shape[1] :].any(), "padding"
            got = got[:, : ref.shape[1]]
        assert got.dtype == ref.dtype and np.array_equal(got, ref), (
            f"plan.{name}: {got.tolist()} != {ref.tolist()}"
        )
    assert list(map(id, rows.logit_seqs)) == list(map(id, want_rows.logit_seqs)), "logit rows"
    want_custom = list(map(id, want_rows.custom_seqs))
    assert [id(seq) for _, seq in handler_rows] == want_custom, "custom rows"
    if plan.wire is not None:
        check_wire(plan)


def check_ahead_plan(
    batch: ScheduledBatch, plan: StepPlan, rows: PlanRows, block_size: int
) -> None:
    """A decode plan scheduled ahead (Scheduler.schedule_ahead): every sequence is one
    token behind it, the token still being sampled (the runner takes the input ids on the
    device), so each row computes position num_tokens and its context holds one more."""
    seqs = batch.seqs
    assert plan.kind is StepKind.DECODE and list(map(id, rows.logit_seqs)) == list(map(id, seqs))
    assert all(s.status is SeqStatus.RUNNING and s.request.runs_ahead for s in seqs)
    assert batch.table_stamps == [s.block_table_version for s in seqs], "table stamps"
    want_lens = [s.num_tokens + 1 for s in seqs]
    assert batch.context_lens == want_lens and plan.context_lens.tolist() == want_lens
    assert plan.positions.tolist() == [s.num_tokens for s in seqs], "positions"
    slots = [
        s.block_table[p // block_size] * block_size + p % block_size
        for s, p in zip(seqs, plan.positions.tolist())
    ]
    assert plan.slot_mapping.tolist() == slots, "slot mapping"
    for s, table in zip(seqs, plan.block_tables):
        width = len(s.block_table)
        assert table[:width].tolist() == s.block_table and not table[width:].any(), "table"
    assert plan.query_start_loc.tolist() == list(range(len(seqs) + 1))
    assert not plan.custom_rows.size and not plan.block_copies.size
    generated = [i for i, s in enumerate(seqs) if s.request.all_generated]
    assert rows.generated.tolist() == generated, "ALL_GENERATED rows"
    assert list(map(id, rows.generated_seqs)) == [id(seqs[i]) for i in generated]
    assert plan.ids_from_rank0, "an ahead plan's ids come from rank 0's device"
    if plan.wire is not None:  # advanced in place: its (re-sealed) message says so too
        check_wire(plan)


def check_wire(plan: StepPlan) -> None:
    """A plan laid out in its message (PlanMessage): the message, sealed, decodes to it."""
    wire = plan.wire
    assert wire.holds(plan), "the plan's arrays are not its message's views"
    wire.seal(plan)
    start = wire.start + TRANSPORT_HEADER_BYTES
    sent = decode_plan(memoryview(wire.buffer[start : start + wire.nbytes]))
    assert (sent.kind, sent.graph_bucket, sent.ids_from_rank0) == (
        plan.kind,
        plan.graph_bucket,
        plan.ids_from_rank0,
    )
    for name in _ARRAY_FIELDS:
        got, ref = getattr(sent, name), getattr(plan, name)
        assert got.dtype == ref.dtype and np.array_equal(got, ref), f"wire {name}"


_CHECKED: dict[type, type] = {}
_CHECKED_PLANNERS: dict[type, type] = {}


def _checked_planner_class(cls: type) -> type:
    if cls not in _CHECKED_PLANNERS:

        def build(self, batch):
            plan, rows = cls.build(self, batch)
            check_plan(batch, plan, rows, self.block_size, getattr(self, "checked_blocks", None))
            return plan, rows

        _CHECKED_PLANNERS[cls] = type(
            f"Checked{cls.__name__}", (cls,), {"build": build, "__module__": __name__}
        )
    return _CHECKED_PLANNERS[cls]


def _checked_class(cls: type) -> type:
    if getattr(cls, "_invariants_watched", False):
        return cls
    if cls not in _CHECKED:

        def step(self, *args, **kwargs):
            outputs = cls.step(self, *args, **kwargs)
            self.steps_checked = getattr(self, "steps_checked", 0) + 1
            check_engine(self)
            return outputs

        _CHECKED[cls] = type(
            f"Checked{cls.__name__}",
            (cls,),
            {"step": step, "_invariants_watched": True, "__module__": __name__},
        )
    return _CHECKED[cls]


def watch_steps(target):
    """Check the invariants after every step of an Engine (or of an LLM's engine); returns
    its argument."""
    engine = getattr(target, "engine", target)
    engine.__class__ = _checked_class(type(engine))
    if not isinstance(engine.planner, tuple(_CHECKED_PLANNERS.values())):
        engine.planner.__class__ = _checked_planner_class(type(engine.planner))
        engine.planner.checked_blocks = engine.blocks
    return target
