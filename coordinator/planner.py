"""Turns a scheduled batch into the StepPlan every rank runs (rank 0 only)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from coordinator.scheduler import ScheduledBatch
from coordinator.sequence import Sequence
from ranks.plan import StepKind, StepPlan


@dataclass
class PlanRows:
    """Which sequences own the plan's logit rows and custom rows, in row order."""
    logit_seqs: list[Sequence] = field(default_factory=list)
    custom_seqs: list[Sequence] = field(default_factory=list)


def needs_custom_row(seq: Sequence, start: int, n: int) -> bool:
    req = seq.request
    return (not req.forked and seq is req.sequences[0] and req.custom_output is None
            and not req.custom_output_skipped and req.error_code is None
            and start <= req.custom_position < start + n)


def build_plan(batch: ScheduledBatch, block_size: int,
               block_copies: list[tuple[int, int]]) -> tuple[StepPlan, PlanRows]:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    tables: list[list[int]] = []
    logit_rows: list[int] = []
    custom_rows: list[int] = []
    rows = PlanRows()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start, offset = seq.num_computed_tokens, len(ids)
        ids += seq.token_ids[start:start + n]
        positions += range(start, start + n)
        table = seq.block_table
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        query_start.append(offset + n)
        context_lens.append(start + n)
        tables.append(table)
        if start + n == seq.num_tokens and seq.request.params.max_new_tokens > 0:
            logit_rows.append(offset + n - 1)
            rows.logit_seqs.append(seq)
        if needs_custom_row(seq, start, n):
            custom_rows.append(offset + seq.request.custom_position - start)
            rows.custom_seqs.append(seq)
    width = max((len(t) for t in tables), default=0)
    block_tables = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = t
    plan = StepPlan(
        kind=_step_kind(batch),
        input_ids=np.asarray(ids, np.int64), positions=np.asarray(positions, np.int64),
        slot_mapping=np.asarray(slots, np.int64), query_start_loc=np.asarray(query_start, np.int32),
        context_lens=np.asarray(context_lens, np.int32), block_tables=block_tables,
        logit_rows=np.asarray(logit_rows, np.int64), custom_rows=np.asarray(custom_rows, np.int64),
        block_copies=np.asarray(block_copies, np.int64).reshape(-1, 2))
    return plan, rows


def _step_kind(batch: ScheduledBatch) -> StepKind:
    decoding = [n == 1 and s.num_computed_tokens == s.num_tokens - 1
                for s, n in zip(batch.seqs, batch.num_new_tokens)]
    if all(decoding):
        return StepKind.DECODE
    return StepKind.MIXED if any(decoding) else StepKind.PREFILL
