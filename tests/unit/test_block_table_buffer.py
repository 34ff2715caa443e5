"""The planner's persistent block-table buffer against a plain rebuild from the sequences'
tables, over random batches: tables that grow by appended blocks, tables replaced outright,
rows that shift as sequences leave, batches that shrink (and the widest table with them) and
grow back."""

from __future__ import annotations

import random
from itertools import count

import numpy as np
import pytest

from tapserve.api.sampling_params import SamplingParams
from tapserve.coordinator.planner import BlockTableBuffer
from tapserve.coordinator.sequence import Request, Sequence


def expected(seqs: list[Sequence], dtype: np.dtype) -> np.ndarray:
    width = max((len(s.block_table) for s in seqs), default=0)
    out = np.zeros((len(seqs), width), dtype)
    for i, s in enumerate(seqs):
        out[i, : len(s.block_table)] = s.block_table
    return out


@pytest.mark.parametrize("dtype", [np.dtype(np.int32), np.dtype(np.uint16)], ids=str)
def test_buffer_matches_a_plain_rebuild_over_random_batches(dtype: np.dtype) -> None:
    rng = random.Random(0)
    stamps = count(1)
    pool = []
    for i in range(40):
        seq = Sequence(i, Request(str(i), [1], SamplingParams(), i), [1], 1)
        seq.block_table = [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        seq.block_table_version = next(stamps)
        pool.append(seq)
    buffer = BlockTableBuffer(dtype)
    seqs = pool[:20]
    for step in range(400):
        for seq in rng.sample(seqs, k=min(len(seqs), 3)):
            if rng.random() < 0.7:  # a new block at the end (BlockManager.append_slot)
                seq.block_table_base = seq.block_table_version
                seq.block_table.append(rng.randrange(1000))
            else:  # replaced (preempted and reallocated, a copy on write, ...)
                seq.block_table_base = -1
                seq.block_table = [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
            seq.block_table_version = next(stamps)
        roll = rng.random()
        if roll < 0.15 and len(seqs) > 1:  # a sequence leaves: the rows after it shift
            seqs.pop(rng.randrange(len(seqs)))
        elif roll < 0.25:  # the batch shrinks for a step, then the same rows come back
            seqs = seqs[: rng.randrange(len(seqs) + 1)] if step % 2 else seqs
        elif roll < 0.4:
            rest = [s for s in pool if s not in seqs]
            seqs = seqs + rng.sample(rest, k=min(2, len(rest)))
        got = gather(buffer, seqs)
        assert got.flags.c_contiguous and got.dtype == dtype
        np.testing.assert_array_equal(got, expected(seqs, dtype), err_msg=f"step {step}")


def gather(buffer: BlockTableBuffer, seqs: list[Sequence]) -> np.ndarray:
    return buffer.gather(seqs, [s.block_table_version for s in seqs])


def test_rows_cut_short_by_a_narrower_batch_are_rewritten() -> None:
    """A batch without the widest table narrows the buffer; when the same sequences come
    back with unchanged stamps, their tables are whole again."""
    seqs = []
    for i, n in enumerate((2, 9, 3)):
        seq = Sequence(i, Request(str(i), [1], SamplingParams(), i), [1], 1)
        seq.block_table, seq.block_table_version = list(range(10 * i, 10 * i + n)), i + 1
        seqs.append(seq)
    buffer = BlockTableBuffer()
    np.testing.assert_array_equal(gather(buffer, seqs), expected(seqs, np.dtype(np.int32)))
    np.testing.assert_array_equal(gather(buffer, seqs[:1]), expected(seqs[:1], np.dtype(np.int32)))
    np.testing.assert_array_equal(gather(buffer, seqs), expected(seqs, np.dtype(np.int32)))
