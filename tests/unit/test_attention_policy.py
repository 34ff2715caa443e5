"""The Triton backend's host-side choices (model/triton_backend.py, model/kernels/extend.py):
the decode KV split count per batch shape, and the extend kernel's work list. Plain Python
and numpy; triton is imported for its helpers, no kernel runs."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed"
)


@needs_triton
def test_decode_split_policy_sizes_the_grid_to_the_gpu() -> None:
    """Powers of two only (each is a kernel variant); batch x KV heads x splits stays at or
    under PROGRAMS_PER_SM per SM (or one split) and is the largest such power of two, unless
    the context limit caps the count (one split per TOKENS_PER_SPLIT tokens, at most
    MAX_KV_SPLITS); the cap never leaves SMs without a program where more splits would fill
    them; fewer KV heads never mean fewer splits, so the backend's workspace, sized for one
    KV head, fits every batch."""
    import triton

    from tapserve.model.triton_backend import (
        MAX_KV_SPLITS,
        MIN_SPLIT_TOKENS,
        PROGRAMS_PER_SM,
        TOKENS_PER_SPLIT,
        decode_split_policy,
    )

    sms = 132
    for limit in (256, 1200, 4096, 40960):
        splits = decode_split_policy(limit, num_sms=sms)
        cap = min(MAX_KV_SPLITS, triton.next_power_of_2(-(-limit // TOKENS_PER_SPLIT)))
        usable = min(MAX_KV_SPLITS, triton.next_power_of_2(-(-limit // MIN_SPLIT_TOKENS)))
        for kv_heads in (1, 2, 8):
            for batch in range(1, 257):
                s = splits(batch, kv_heads)
                programs = batch * kv_heads * s
                assert 1 <= s <= usable and s & (s - 1) == 0
                assert s <= cap or programs <= sms  # above the cap only to fill the SMs
                assert s == 1 or programs <= PROGRAMS_PER_SM * sms
                assert s >= cap or 2 * programs > PROGRAMS_PER_SM * sms
                assert s == usable or 2 * programs > sms  # no SM left idle
                assert s <= splits(batch, 1)
    # measured best at contexts 100-2048, longest context first (docs/benchmarks.md)
    best = {256: 1, 128: 1, 64: 2, 32: 4, 16: 8}
    assert {b: decode_split_policy(4096, sms)(b, 8) for b in best} == best
    assert decode_split_policy(40960, sms)(1, 8) == MAX_KV_SPLITS
    # a short limit (decode_sweep's 1.3K) caps batch 2 at 8 splits; batch 1 takes 16 so that
    # its 8 KV heads fill the 132 SMs (measured faster on the H200, docs/benchmarks.md)
    assert [decode_split_policy(1300, sms)(b, 8) for b in (1, 2, 4, 8)] == [16, 8, 8, 8]
    # one KV head per rank: no more splits than a 1.3K context can fill (64 tokens each)
    assert decode_split_policy(1300, sms)(1, 1) == 32
    assert decode_split_policy(256, sms)(1, 1) == 4


@needs_triton
def test_extend_work_lists_each_chosen_sequences_row_blocks() -> None:
    """One entry per BLOCK_M rows of each chosen sequence, in order, none for the others."""
    from tapserve.model.kernels.extend import extend_work

    work = extend_work(np.array([5, 64, 65, 1, 0, 130]), 64)
    assert work.dtype == np.int32
    assert work.tolist() == [[0, 0], [1, 0], [2, 0], [2, 64], [3, 0], [5, 0], [5, 64], [5, 128]]
    assert extend_work(np.array([5, 64, 65, 1]), 32, np.array([2, 0])).tolist() == [
        [2, 0],
        [2, 32],
        [2, 64],
        [0, 0],
    ]
    assert extend_work(np.array([3, 1]), 64, np.array([], dtype=np.int64)).shape == (0, 2)
