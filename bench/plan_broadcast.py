"""Plan build + broadcast per decode step at batch 256 (context 2K, block size 16) over gloo with
2 ranks, side by side with one bare gloo broadcast of the same number of bytes.
Goal: at most 1.5x the bare broadcast.

    python bench/plan_broadcast.py [--batch 256] [--context 2048] [--steps 200] [--rounds 5]

The planner is the engine's (its block-table buffer persists across steps). Between plans the
batch decodes as in the engine (DecodeSimulation, not timed): every sequence advances by a
token and one in 16 takes a new block (its table grows by an entry, with a new stamp). The
bare broadcast has the size of the plan halfway through a round. Bare and plan rounds
alternate; the best round of each is reported (shared machines are noisy), with the best
round's phases in microseconds per step: rank 0's build and send (encode and broadcast),
rank 1's receive (broadcast and decode).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from itertools import count
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.planner import Planner  # noqa: E402
from coordinator.sampling_params import SamplingParams  # noqa: E402
from coordinator.scheduler import ScheduledBatch  # noqa: E402
from coordinator.sequence import Request, Sequence, SeqStatus  # noqa: E402
from ranks.group import PlanChannel  # noqa: E402
from ranks.plan import encode_plan  # noqa: E402


def decode_batch(batch: int, context: int, block_size: int) -> ScheduledBatch:
    """batch sequences decoding at about `context` tokens, staggered so that one in
    block_size takes a new block at each step."""
    out = ScheduledBatch()
    for i in range(batch):
        length = context - i % block_size
        blocks = -(-length // block_size)
        req = Request(str(i), [1] * (length - 1), SamplingParams(), i)
        seq = Sequence(i, req, [1] * length, length - 1, status=SeqStatus.RUNNING,
                       block_table=list(range(i * 1000, i * 1000 + blocks)),
                       num_computed_tokens=length - 1, block_table_version=i + 1)
        req.sequences.append(seq)
        out.seqs.append(seq)
        out.num_new_tokens.append(1)
        out.context_lens.append(length)
    return out


class DecodeSimulation:
    """What the engine does to the batch between two plans, done the engine's way: every
    sequence appends a token and advances by one, and a sequence whose tokens outgrow its
    table appends a block (BlockManager.append_slot: new stamp, the old one as its base)."""

    def __init__(self, batch: ScheduledBatch, block_size: int, first_stamp: int):
        self.batch, self.block_size, self.stamps = batch, block_size, count(first_stamp)

    def advance(self) -> None:
        batch = self.batch
        for seq in batch.seqs:
            seq.token_ids.append(1)
            seq.num_computed_tokens += 1
            if len(seq.token_ids) > len(seq.block_table) * self.block_size:
                seq.block_table.append(seq.block_table[-1] + 1)
                seq.block_table_base = seq.block_table_version
                seq.block_table_version = next(self.stamps)
        batch.context_lens = [len(seq.token_ids) for seq in batch.seqs]


def worker(rank: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    channel = PlanChannel(dist.group.WORLD)
    planner = Planner(16)
    # the bare broadcast's size: the plan halfway through a round (tables grow as it decodes)
    sizes = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        probe = decode_batch(args.batch, args.context + args.steps // 2, 16)
        sizes[0] = len(encode_plan(Planner(16).build(probe)[0]))
    dist.broadcast(sizes, src=0)
    nbytes = int(sizes[0])
    bare = torch.zeros(nbytes, dtype=torch.uint8)
    timings: dict[str, float] = {}
    phases = {"build": [], "send": [], "recv": []}  # per plan round: mean us per step
    for name in ("bare", "plan") * (args.rounds + 1):  # the first pair is a warm-up
        if name == "plan" and rank == 0:  # each round decodes from the same start
            batch = decode_batch(args.batch, args.context, 16)
            simulation = DecodeSimulation(batch, 16, first_stamp=(len(timings) + 1) * 10**6)
        dist.barrier()
        start = time.perf_counter()
        spent = {"build": 0.0, "send": 0.0, "recv": 0.0, "simulation": 0.0}
        for _ in range(args.steps):
            if name == "bare":
                dist.broadcast(bare, src=0)
            elif rank == 0:
                t0 = time.perf_counter()
                plan = planner.build(batch)[0]
                t1 = time.perf_counter()
                channel.send(plan)
                t2 = time.perf_counter()
                simulation.advance()
                spent["build"] += t1 - t0
                spent["send"] += t2 - t1
                spent["simulation"] += time.perf_counter() - t2
            else:
                t0 = time.perf_counter()
                channel.recv()
                spent["recv"] += time.perf_counter() - t0
        dist.barrier()
        # the simulated engine work between plans is not the plan's cost
        elapsed = (time.perf_counter() - start - spent["simulation"]) / args.steps * 1e3
        timings[name] = elapsed if name not in timings else min(timings[name], elapsed)
        if name == "plan":
            for key in ("build", "send") if rank == 0 else ("recv",):
                phases[key].append(spent[key] / args.steps * 1e6)
    results[f"phases_rank{rank}"] = {k: round(min(v[1:]), 1) for k, v in phases.items() if v}
    if rank == 0:
        results.update({"batch": args.batch, "context": args.context, "plan_bytes": nbytes,
                        "bare_broadcast_ms": round(timings["bare"], 3),
                        "plan_build_and_broadcast_ms": round(timings["plan"], 3),
                        "ratio": round(timings["plan"] / timings["bare"], 2)})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(port, args, results), nprocs=2)
        out = dict(results)
        # best round of each phase, us per step: rank 0's build and send (encode + broadcast),
        # rank 1's receive (broadcast + decode)
        out["phases_us"] = {**out.pop("phases_rank0"), **out.pop("phases_rank1")}
        print(json.dumps(out))


if __name__ == "__main__":
    main()
