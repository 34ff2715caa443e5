"""PlanChannel over a real 2-rank gloo group: plans of changing sizes arrive intact, and a
plan that fits the size agreed in the previous message costs exactly one broadcast; the same
for plans laid out in their wire message (PlanMessage, sent from its own buffer), widened in
place or not. The receive a receiver posts ahead neither times out through its own step nor
keeps a failing rank alive."""
from __future__ import annotations

import socket
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ranks.group import PeerTimeout, PlanChannel
from ranks.plan import PlanMessage, StepKind, StepPlan
from ranks.worker import run_worker

# block-table shapes (rows, cols) of int32: ~1 KB, 100 KB, 104 KB, 300 KB, 1 KB, 1 KB
SHAPES = [(16, 16), (200, 128), (208, 128), (600, 128), (16, 16), (16, 16)]
# broadcasts per plan: 16 KiB agreed first; 100 KB overflows (2), the next is sized to fit
# it with headroom, 104 KB fits (1), 300 KB overflows (2), then everything fits again
EXPECTED_BROADCASTS = [1, 2, 1, 2, 1, 1]


def _plan(i: int, wider: int = 0) -> StepPlan:
    rows, cols = SHAPES[i]
    tables = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols) + i
    tables = np.pad(tables, ((0, 0), (0, wider)))
    return StepPlan(kind=StepKind.DECODE, input_ids=np.arange(rows, dtype=np.int64) * (i + 1),
                    context_lens=np.full(rows, 7 + i, np.int32), block_tables=tables)


def _laid_out(i: int, wider: int) -> StepPlan:
    """_plan(i, wider) from a PlanMessage of _plan(i), widened in place."""
    message = PlanMessage(_plan(i))
    if wider:
        assert message.widen(SHAPES[i][1] + wider)
    return message.plan(StepKind.DECODE)


def _equal(a: StepPlan, b: StepPlan) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f))
               for f in ("input_ids", "context_lens", "block_tables"))


def _rank(rank: int, port: int, laid_out: bool, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    calls = []
    real_broadcast = dist.broadcast

    def counting_broadcast(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_broadcast(tensor, *args, **kwargs)
    dist.broadcast = counting_broadcast
    encodes = []
    import ranks.group
    real_encoded = ranks.group.EncodedPlan
    ranks.group.EncodedPlan = lambda plan: encodes.append(1) or real_encoded(plan)
    channel = PlanChannel(dist.group.WORLD)
    counts, intact = [], []
    for i in range(len(SHAPES)):
        before = len(calls)
        wider = i % 2 if laid_out else 0
        if rank == 0:
            channel.send(_laid_out(i, wider) if laid_out else _plan(i))
        else:
            got, want = channel.recv(), _plan(i, wider)
            time.sleep(0.05)  # the next plan lands meanwhile, in the other receive buffer
            intact.append(_equal(got, want))  # a received plan stays valid until the next recv
        counts.append(len(calls) - before)
    plans_encoded = len(encodes)
    if rank == 0:  # a stop plan: the receiver posts no receive after it
        channel.send(StepPlan(kind=StepKind.STOP))
    else:
        intact.append(channel.recv().kind is StepKind.STOP)
    results[rank] = {"counts": counts, "intact": intact, "encodes": plans_encoded,
                     "broadcasts": len(calls)}
    dist.barrier()  # no receive is left posted: the group is free for other collectives
    dist.destroy_process_group()


@pytest.mark.parametrize("laid_out", [False, True], ids=["encoded", "laid-out"])
def test_plans_of_changing_size_one_broadcast_when_they_fit(laid_out: bool) -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(_free_port(), laid_out, results), nprocs=2)
        results = dict(results)
    assert results[1]["intact"] == [True] * (len(SHAPES) + 1)
    assert results[0]["counts"] == EXPECTED_BROADCASTS  # the receiver posts each one ahead
    assert results[0]["broadcasts"] == results[1]["broadcasts"] == sum(EXPECTED_BROADCASTS) + 1
    assert results[0]["encodes"] == (0 if laid_out else len(SHAPES))  # laid out: sent as is


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _patient_rank(rank: int, port: int, results) -> None:
    """Peer timeout 1 s, on a group whose own operations would wait 60 s. Rank 0 sends at 0,
    1, 4.5 and 7 s; rank 1 asks at 0, 2.5 (after a step of its own), 2.5 again, 6 and 7.5 s.
    Every send finds the receive posted ahead, so none waits, although rank 1 is busy; the
    posted receive does not time out through rank 1's step (the wait counts from when rank
    1 starts waiting); rank 0's stall times rank 1's third wait out after 1 s, and the
    receive it had posted then still takes the late plan. (The plans are small: a plan
    over the agreed size sends its remainder into a receive posted only on arrival.)"""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    channel = PlanChannel(dist.group.WORLD, peer_timeout=timedelta(seconds=1))
    if rank == 0:
        sends = []
        for i, pause in enumerate([0.0, 1.0, 3.5, 2.5]):
            time.sleep(pause)
            start = time.perf_counter()
            channel.send(StepPlan(kind=StepKind.STOP) if i == 3 else _plan((0, 4, 5)[i]))
            sends.append(time.perf_counter() - start)
        results[rank] = sends
    else:
        events = [_equal(channel.recv(), _plan(0))]
        time.sleep(2.5)  # a long step of rank 1's own, with the next receive posted
        events.append(_equal(channel.recv(), _plan(4)))  # arrived 1.5 s ago
        start = time.perf_counter()
        try:
            channel.recv()
        except PeerTimeout:
            events.append(round(time.perf_counter() - start))
        time.sleep(2.5)
        events.append(_equal(channel.recv(), _plan(5)))  # the late plan, into the posted receive
        time.sleep(1.5)
        events.append(channel.recv().kind is StepKind.STOP)
        results[rank] = events
    dist.barrier()
    dist.destroy_process_group()


def test_peer_timeout_counts_from_the_wait_not_the_posted_receive() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_patient_rank, args=(_free_port(), results), nprocs=2)
        assert results[1] == [True, True, 1, True, True]
        assert max(results[0]) < 0.5, results[0]  # no send waited for rank 1


class _FailingRunner:
    def execute(self, plan: StepPlan) -> None:
        raise RuntimeError("rank 1's step failed")


def _failing_worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    channel = PlanChannel(dist.group.WORLD)
    if rank == 0:
        channel.send(_plan(0))
        time.sleep(60)  # alive, sending nothing more: rank 1 must not wait for it
    else:
        run_worker(_FailingRunner(), channel)


def test_a_failing_worker_exits_at_once_with_a_receive_posted() -> None:
    """A worker whose step raises ends its process non-zero at once, although its channel
    holds the next plan's receive posted (a normal exit would wait on it until rank 0
    goes)."""
    port, ctx = _free_port(), mp.get_context("spawn")
    ranks = [ctx.Process(target=_failing_worker, args=(r, port)) for r in (0, 1)]
    for p in ranks:
        p.start()
    try:
        ranks[1].join(timeout=30)
        assert ranks[1].exitcode == 1
        assert ranks[0].is_alive()  # rank 1 did not wait for rank 0 to go
    finally:
        for p in ranks:
            p.kill()
            p.join()
