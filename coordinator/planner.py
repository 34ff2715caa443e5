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


def scores_last_token(seq: Sequence, start: int, n: int) -> bool:
    """A finishing LAST_GENERATED sequence whose last token is computed in this step: its row
    goes to the handler instead of the sampler."""
    return seq.scoring_reason is not None and start + n == seq.num_tokens


def build_plan(batch: ScheduledBatch, block_size: int,
               block_copies: list[tuple[int, int]]) -> tuple[StepPlan, PlanRows]:
    kind = _step_kind(batch)
    if kind is StepKind.DECODE:
        return _decode_plan(batch, block_size, block_copies)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
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
        if scores_last_token(seq, start, n):
            custom_rows.append(offset + n - 1)
            rows.custom_seqs.append(seq)
        elif start + n == seq.num_tokens and seq.request.params.max_new_tokens > 0:
            logit_rows.append(offset + n - 1)
            rows.logit_seqs.append(seq)
        if needs_custom_row(seq, start, n):
            custom_rows.append(offset + seq.request.custom_position - start)
            rows.custom_seqs.append(seq)
    plan = StepPlan(
        kind=kind,
        input_ids=np.asarray(ids, np.int64), positions=np.asarray(positions, np.int64),
        slot_mapping=np.asarray(slots, np.int64), query_start_loc=np.asarray(query_start, np.int32),
        context_lens=np.asarray(context_lens, np.int32), block_tables=_block_tables(batch.seqs),
        logit_rows=np.asarray(logit_rows, np.int64), custom_rows=np.asarray(custom_rows, np.int64),
        block_copies=np.asarray(block_copies, np.int64).reshape(-1, 2))
    return plan, rows


def _step_kind(batch: ScheduledBatch) -> StepKind:
    decoding = [n == 1 and s.num_computed_tokens == s.num_tokens - 1
                for s, n in zip(batch.seqs, batch.num_new_tokens)]
    if all(decoding):
        return StepKind.DECODE
    return StepKind.MIXED if any(decoding) else StepKind.PREFILL


@dataclass
class _TableCache:
    """A sequence's block table as numpy, rebuilt only when the block manager changed it."""
    version: int
    array: np.ndarray


def _table_array(seq: Sequence) -> np.ndarray:
    cache = seq.table_cache
    if cache is None or cache.version != seq.block_table_version:
        cache = seq.table_cache = _TableCache(seq.block_table_version,
                                              np.asarray(seq.block_table, np.int32))
    return cache.array


def _block_tables(seqs: list[Sequence]) -> np.ndarray:
    arrays = [_table_array(s) for s in seqs]
    out = np.zeros((len(arrays), max((len(a) for a in arrays), default=0)), np.int32)
    for i, a in enumerate(arrays):
        out[i, :len(a)] = a
    return out


def _decode_plan(batch: ScheduledBatch, block_size: int,
                 block_copies: list[tuple[int, int]]) -> tuple[StepPlan, PlanRows]:
    """The common case, vectorized: every sequence computes its one newest token."""
    seqs = batch.seqs
    rows, logit_rows, custom_rows, ids, lens = PlanRows(), [], [], [], []
    for i, s in enumerate(seqs):
        tokens = s.token_ids
        ids.append(tokens[-1])
        lens.append(len(tokens))
        if s.scoring_reason is not None:  # LAST_GENERATED: one more decode row
            custom_rows.append(i)
            rows.custom_seqs.append(s)
        elif s.request.params.max_new_tokens > 0:
            logit_rows.append(i)
            rows.logit_seqs.append(s)
    ids = np.asarray(ids, np.int64)
    context_lens = np.asarray(lens, np.int32)
    positions = context_lens.astype(np.int64) - 1
    tables = _block_tables(seqs)
    blocks = tables[np.arange(len(seqs)), positions // block_size].astype(np.int64)
    plan = StepPlan(
        kind=StepKind.DECODE, input_ids=ids, positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        query_start_loc=np.arange(len(seqs) + 1, dtype=np.int32), context_lens=context_lens,
        block_tables=tables,
        logit_rows=np.asarray(logit_rows, np.int64),
        custom_rows=np.asarray(custom_rows, np.int64),
        block_copies=np.asarray(block_copies, np.int64).reshape(-1, 2))
    return plan, rows
