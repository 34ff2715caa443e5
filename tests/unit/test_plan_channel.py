"""PlanChannel over a real 2-rank gloo group: plans of changing sizes arrive intact, and a
plan that fits the size agreed in the previous message costs exactly one broadcast; the same
for plans laid out in their wire message (PlanMessage, sent from its own buffer), widened in
place or not."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tapserve.ranks.group import PlanChannel
from tapserve.ranks.plan import PlanMessage, StepKind, StepPlan

# block-table shapes (rows, cols) of int32: ~1 KB, 100 KB, 104 KB, 300 KB, 1 KB, 1 KB
SHAPES = [(16, 16), (200, 128), (208, 128), (600, 128), (16, 16), (16, 16)]
# broadcasts per plan: 16 KiB agreed first; 100 KB overflows (2), the next is sized to fit
# it with headroom, 104 KB fits (1), 300 KB overflows (2), then everything fits again
EXPECTED_BROADCASTS = [1, 2, 1, 2, 1, 1]


def _plan(i: int, wider: int = 0) -> StepPlan:
    rows, cols = SHAPES[i]
    tables = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols) + i
    tables = np.pad(tables, ((0, 0), (0, wider)))
    return StepPlan(
        kind=StepKind.DECODE,
        input_ids=np.arange(rows, dtype=np.int64) * (i + 1),
        context_lens=np.full(rows, 7 + i, np.int32),
        block_tables=tables,
    )


def _laid_out(i: int, wider: int) -> StepPlan:
    """_plan(i, wider) from a PlanMessage of _plan(i), widened in place."""
    message = PlanMessage(_plan(i))
    if wider:
        assert message.widen(SHAPES[i][1] + wider)
    return message.plan(StepKind.DECODE)


def _equal(a: StepPlan, b: StepPlan) -> bool:
    return all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("input_ids", "context_lens", "block_tables")
    )


def _rank(rank: int, store: str, laid_out: bool, results, spin_s: float = 0.0) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    calls = []
    real_broadcast = dist.broadcast

    def counting_broadcast(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_broadcast(tensor, *args, **kwargs)

    dist.broadcast = counting_broadcast
    encodes = []
    from tapserve.ranks import group as group_module

    real_encoded = group_module.EncodedPlan
    group_module.EncodedPlan = lambda plan: encodes.append(1) or real_encoded(plan)
    channel = PlanChannel(dist.group.WORLD, spin_s=spin_s)
    counts, intact = [], []
    for i in range(len(SHAPES)):
        before = len(calls)
        wider = i % 2 if laid_out else 0
        if rank == 0:
            channel.send(_laid_out(i, wider) if laid_out else _plan(i))
        else:
            got, want = channel.recv(), _plan(i, wider)
            time.sleep(0.02)  # rank 0 sends the next plan meanwhile: it must not land yet
            intact.append(_equal(got, want))  # a received plan stays valid until the next recv
        counts.append(len(calls) - before)
    results[rank] = {"counts": counts, "intact": intact, "encodes": len(encodes)}
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "laid_out,spin_s",
    [(False, 0.0), (True, 0.0), (True, 0.005)],
    ids=["encoded", "laid-out", "laid-out-polled"],
)
def test_plans_of_changing_size_one_broadcast_when_they_fit(
    laid_out: bool, spin_s: float, tmp_path
) -> None:
    """(polled: rank 1 polls for each plan up to 5 ms before it blocks, as on CUDA)"""
    store = str(tmp_path / "store")  # a file store: no TCP port to pick and lose to a race
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(store, laid_out, results, spin_s), nprocs=2)
        results = dict(results)
    assert results[1]["intact"] == [True] * len(SHAPES)
    assert results[0]["counts"] == results[1]["counts"] == EXPECTED_BROADCASTS
    assert results[0]["encodes"] == (0 if laid_out else len(SHAPES))  # laid out: sent as is
