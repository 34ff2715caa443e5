"""Turns a scheduled batch into the StepPlan every rank runs (rank 0 only)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tapserve.coordinator.scheduled_batch import ScheduledBatch
from tapserve.coordinator.sequence import Sequence
from tapserve.ranks.plan import PlanMessage, StepKind, StepPlan


@dataclass
class PlanRows:
    """Which sequences own the plan's logit rows and custom rows, in row order, and each
    custom row's position in its sequence's prompt + generated ids."""

    logit_seqs: list[Sequence] = field(default_factory=list)
    custom_seqs: list[Sequence] = field(default_factory=list)
    custom_positions: list[int] = field(default_factory=list)
    # a plain decode plan's ALL_GENERATED rows (int64 row indices) and their sequences: each
    # row's hidden state is its newest token's handler row (not in plan.custom_rows)
    generated: np.ndarray = field(default_factory=lambda: _NONE)
    generated_seqs: list[Sequence] = field(default_factory=list)


_NONE = np.zeros(0, np.int64)


def needs_custom_row(seq: Sequence, start: int, n: int) -> bool:
    req = seq.request
    return (
        not req.forked
        and seq is req.sequences[0]
        and req.custom_output is None
        and not req.custom_output_skipped
        and req.error_code is None
        and start <= req.custom_position < start + n
    )


def scores_last_token(seq: Sequence, start: int, n: int) -> bool:
    """A finishing LAST_GENERATED sequence computes its last token now: a handler row."""
    return seq.scoring_reason is not None and start + n == seq.num_tokens


def custom_positions(seq: Sequence, start: int, n: int) -> list[int]:
    """The positions in [start, start + n) whose hidden states go to the handler, ascending."""
    req = seq.request
    if req.selection is None:
        found = [req.custom_position] if needs_custom_row(seq, start, n) else []
        return found + ([start + n - 1] if scores_last_token(seq, start, n) else [])
    if req.error_code is not None:
        return []
    found = []
    prompt = req.selection.prompt
    if req.next_prompt_row < len(prompt) and seq is req.sequences[0] and not req.forked:
        found = [p for p in prompt[req.next_prompt_row :] if start <= p < start + n]
    if req.all_generated:
        first = max(start, seq.num_prompt_tokens + seq.num_scored)
        found += range(first, start + n)
    elif scores_last_token(seq, start, n):
        found.append(start + n - 1)
    return found


TABLE_WIDTH_STEP = 16  # advanced plans' block tables: a multiple of this many columns


@dataclass
class _Advanceable:
    """The last decode plan, laid out in its message, that a steady step may advance."""

    serial: int  # of the batch it was built for
    plan: StepPlan
    rows: PlanRows
    stamps: list[int]  # the rows' table stamps, as its block tables hold them
    advanced: bool  # built by advancing: the block-table buffer has not seen its tables


class Planner:
    """Builds each step's plan; keeps the block-table buffer, and the last plain decode plan in
    its wire message, which a steady step (ScheduledBatch.follows) advances in place."""

    def __init__(
        self,
        block_size: int,
        max_table_width: int | None = None,
        width_step: int = TABLE_WIDTH_STEP,
        table_dtype: np.dtype = np.dtype(np.int32),
    ):
        """max_table_width: the most blocks a table may hold; advanced plans pad their tables
        to multiples of width_step columns up to it. table_dtype: the plans' block-table dtype."""
        self.block_size = block_size
        self.max_table_width, self.width_step = max_table_width, width_step
        self.tables = BlockTableBuffer(table_dtype)
        self._ranges: dict[int, np.ndarray] = {}  # n -> arange(n + 1), shared by decode plans
        self._advanceable: _Advanceable | None = None

    def build(self, batch: ScheduledBatch) -> tuple[StepPlan, PlanRows]:
        last, self._advanceable = self._advanceable, None
        if (
            last is not None
            and batch.follows == last.serial
            and not batch.block_copies
            and len(batch.seqs) == last.plan.num_seqs
        ):  # (follows promises the same rows)
            plan = self._advance(last.plan, batch)
            rows = PlanRows(list(batch.seqs), [], [], last.rows.generated, last.rows.generated_seqs)
            self._advanceable = _Advanceable(batch.serial, plan, rows, batch.table_stamps, True)
            return plan, rows
        if last is not None and last.advanced:  # the buffer lags behind the advanced tables
            plan = last.plan
            self.tables.adopt(
                plan.block_tables, last.stamps, -(-plan.context_lens // self.block_size)
            )
        seqs = batch.seqs
        context_lens = np.asarray(batch.context_lens, np.int32)
        counts = batch.num_new_tokens
        tables = self.tables.gather(seqs, batch.table_stamps)
        if not batch.partial and counts.count(1) == len(counts):
            plan, rows = _decode_plan(
                batch, self.block_size, tables, context_lens, self._range(len(seqs))
            )
            if not batch.has_special_rows and not batch.block_copies:  # a steady step may follow
                spare = last.plan.wire.buffer if last is not None else None  # used up
                plan = PlanMessage(plan, self._table_width(tables.shape[1]), spare).plan(
                    plan.kind, ids_from_rank0=plan.ids_from_rank0
                )
                self._advanceable = _Advanceable(
                    batch.serial, plan, rows, batch.table_stamps, False
                )
            return plan, rows
        one_token = np.asarray(counts) == 1
        decoding = one_token & (context_lens == np.asarray([len(s.token_ids) for s in seqs]))
        kind = StepKind.MIXED if decoding.any() else StepKind.PREFILL
        return _mixed_plan(batch, kind, self.block_size, tables, context_lens)

    def _advance(self, plan: StepPlan, batch: ScheduledBatch) -> StepPlan:
        """plan's rows one token further, written over plan's arrays; batch follows plan's
        batch (the same rows, only those of batch.grown_rows with a new block)."""
        grown, blocks = batch.grown_rows, batch.grown_blocks
        # safe while its step is queued: CUDA stages pageable copies before they return
        if batch.last_token_ids is not None:  # else the runner takes them on the device
            plan.input_ids[:] = batch.last_token_ids
        plan.positions += 1
        plan.context_lens += 1
        plan.slot_mapping += 1  # the slot after the last one, but in a new block:
        if grown.size:
            width = int(batch.grown_cols.max()) + 1
            if width > plan.block_tables.shape[1]:  # the longest table outgrew the padding
                width = self._table_width(width)
                wire = plan.wire if plan.wire.widen(width) else PlanMessage(plan, width)
                plan = wire.plan(StepKind.DECODE)
            plan.block_tables[grown, batch.grown_cols] = blocks
            plan.slot_mapping[grown] = blocks * self.block_size  # its first slot
        plan.ids_from_rank0 = batch.last_token_ids is None
        return plan

    def _table_width(self, width: int) -> int:
        """width rounded up to a whole width_step, at most max_table_width."""
        padded = -(-width // self.width_step) * self.width_step
        return max(width, min(padded, self.max_table_width or padded))

    def _range(self, n: int) -> np.ndarray:
        """arange(n + 1) as int64, made once per batch size and never written."""
        if n not in self._ranges:
            self._ranges[n] = np.arange(n + 1, dtype=np.int64)
        return self._ranges[n]


def _mixed_plan(
    batch: ScheduledBatch,
    kind: StepKind,
    block_size: int,
    tables: np.ndarray,
    context_lens: np.ndarray,
) -> tuple[StepPlan, PlanRows]:
    """Prefill chunks and decode rows together, token by token."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    logit_rows: list[int] = []
    custom_rows: list[int] = []
    rows = PlanRows()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start, offset = seq.num_computed_tokens, len(ids)
        ids += seq.token_ids[start : start + n]
        positions += range(start, start + n)
        table = seq.block_table
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(start, start + n)
        ]
        query_start.append(offset + n)
        if start + n == seq.num_tokens and seq.scoring_reason is None:
            if seq.request.params.max_new_tokens > 0:
                logit_rows.append(offset + n - 1)
                rows.logit_seqs.append(seq)
        for p in custom_positions(seq, start, n):
            custom_rows.append(offset + p - start)
            rows.custom_seqs.append(seq)
            rows.custom_positions.append(p)
    plan = StepPlan(
        kind=kind,
        input_ids=np.asarray(ids, np.int64),
        positions=np.asarray(positions, np.int64),
        slot_mapping=np.asarray(slots, np.int64),
        query_start_loc=np.asarray(query_start, np.int32),
        context_lens=context_lens,
        block_tables=tables,
        logit_rows=np.asarray(logit_rows, np.int64),
        custom_rows=np.asarray(custom_rows, np.int64),
        block_copies=_copies(batch),
    )
    return plan, rows


def _copies(batch: ScheduledBatch) -> np.ndarray:
    if not batch.block_copies:
        return np.zeros((0, 2), np.int64)
    return np.asarray(batch.block_copies, np.int64).reshape(-1, 2)


_NO_TABLE = -2  # a buffer row's stamp when it holds no whole table (never a table's base)


class BlockTableBuffer:
    """The batch's block tables as one persistent [rows, longest table] array whose first rows
    are the plan's array (a view); a row is rewritten only when its table's stamp
    (Sequence.block_table_version) changed."""

    def __init__(self, dtype: np.dtype = np.dtype(np.int32)) -> None:
        self._array = np.zeros((0, 0), dtype)
        # per row: the stamp of the table it holds, and that table's length
        self._version = self._length = np.zeros(0, np.int64)

    def gather(self, seqs: list[Sequence], stamps: list[int]) -> np.ndarray:
        """The tables of seqs, zero-padded, as a view valid until the next gather. stamps:
        each sequence's block_table_version as the scheduler read it."""
        n = len(seqs)
        version = np.array(stamps, np.int64)
        self._reserve_rows(n)
        stale = np.flatnonzero(self._version[:n] != version)
        if stale.size:
            self._update(seqs, stale)
        self._version[:n] = version
        width = int(self._length[:n].max(initial=0))
        if width != self._array.shape[1]:  # the longest table left the batch
            self._set_width(width)
        return self._array[:n]

    def adopt(self, tables: np.ndarray, stamps: list[int], lengths: np.ndarray) -> None:
        """Take tables (zero-padded) as the first n rows of the given stamps and lengths, as
        if gathered."""
        n, width = tables.shape[0], int(lengths.max(initial=0))
        tables = tables[:, :width]
        self._reserve_rows(n)
        if width != self._array.shape[1]:
            self._set_width(width)
        self._array[:n] = tables
        self._version[:n] = stamps
        self._length[:n] = lengths

    def _update(self, seqs: list[Sequence], stale: np.ndarray) -> None:
        """Rewrite the stale rows; tables that only grew get their new entries in one scatter."""
        indices = stale.tolist()
        held = zip(self._version[stale].tolist(), self._length[stale].tolist())
        rows, cols, values, lengths = [], [], [], []
        for i, (version, length) in zip(indices, held):
            seq = seqs[i]
            table = seq.block_table
            start = length if version == seq.block_table_base else 0
            if start:  # only grew: its new entries go into the scatter
                rows += [i] * (len(table) - start)
                cols += range(start, len(table))
                values += table[start:]
            else:
                if len(table) > self._array.shape[1]:
                    self._set_width(len(table))
                self._array[i, : len(table)] = table
                self._array[i, len(table) :] = 0
            lengths.append(len(table))
        if rows:
            if max(cols) >= self._array.shape[1]:
                self._set_width(max(cols) + 1)
            self._array[rows, cols] = values
        self._length[stale] = lengths

    def _reserve_rows(self, rows: int) -> None:
        have = self._array.shape[0]
        if rows > have:
            grow = max(rows, 2 * have) - have
            more = np.zeros((grow, self._array.shape[1]), self._array.dtype)
            self._array = np.vstack([self._array, more])
            pad = np.full(grow, _NO_TABLE, np.int64)
            self._version = np.concatenate([self._version, pad])
            self._length = np.concatenate([self._length, np.zeros(grow, np.int64)])

    def _set_width(self, width: int) -> None:
        """Re-lay the buffer at a new width (the longest table grew, or left the batch)."""
        self._version[self._length > width] = _NO_TABLE  # rows cut short must be rewritten
        resized = np.zeros((self._array.shape[0], width), self._array.dtype)
        keep = min(width, self._array.shape[1])
        resized[:, :keep] = self._array[:, :keep]
        self._array = resized
        np.minimum(self._length, width, out=self._length)


def _decode_plan(
    batch: ScheduledBatch,
    block_size: int,
    tables: np.ndarray,
    context_lens: np.ndarray,
    arange: np.ndarray,
) -> tuple[StepPlan, PlanRows]:
    """Every sequence computes its newest token. arange: arange(len(seqs) + 1), int64."""
    seqs = batch.seqs
    n = len(seqs)
    positions = context_lens - 1  # int32 here; int64 on the wire (the StepPlan dtypes)
    blocks = tables[arange[:n], positions // block_size]
    slots = blocks.astype(np.int64)
    slots *= block_size
    slots += positions % block_size
    rows, logit_rows, custom_rows = _decode_rows(seqs, batch.has_special_rows, arange[:n])
    ids = batch.last_token_ids  # None: still on the device, where the runner takes them
    plan = StepPlan(
        kind=StepKind.DECODE,
        input_ids=np.zeros(n, np.int64) if ids is None else np.array(ids, np.int64),
        positions=positions.astype(np.int64),
        slot_mapping=slots,
        query_start_loc=arange.astype(np.int32),
        context_lens=context_lens,
        block_tables=tables,
        logit_rows=logit_rows,
        custom_rows=custom_rows,
        block_copies=_copies(batch),
        ids_from_rank0=ids is None,
    )
    return plan, rows


def _decode_rows(
    seqs: list[Sequence], has_special_rows: bool, every_row: np.ndarray
) -> tuple[PlanRows, np.ndarray, np.ndarray]:
    """Every row samples, except a sequence scoring its last token (a handler row) and a
    scoring-only request (max_new_tokens = 0); a prompt's last token may also be a custom row.
    every_row: arange(len(seqs)), int64."""
    if not has_special_rows:
        generated = [i for i, s in enumerate(seqs) if s.request.all_generated]
        rows = PlanRows(list(seqs), [], [], _NONE, [seqs[i] for i in generated])
        if generated:
            rows.generated = every_row if len(generated) == len(seqs) else np.array(generated)
        return rows, every_row, _NONE
    rows, logit_rows, custom_rows = PlanRows(), [], []
    for i, s in enumerate(seqs):
        if s.scoring_reason is None and s.request.params.max_new_tokens > 0:
            logit_rows.append(i)
            rows.logit_seqs.append(s)
        for p in custom_positions(s, s.num_computed_tokens, 1):
            custom_rows.append(i)
            rows.custom_seqs.append(s)
            rows.custom_positions.append(p)
    return rows, np.asarray(logit_rows, np.int64), np.asarray(custom_rows, np.int64)
