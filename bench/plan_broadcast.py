"""Plan build + broadcast per decode step at batch 256 (context 2K, block size 16) over gloo with
2 ranks, side by side with one bare gloo broadcast of the same number of bytes.
Goal: at most 1.5x the bare broadcast.

    python bench/plan_broadcast.py [--batch 256] [--context 2048] [--steps 200] [--rounds 5]

The planner is the engine's (its block-table buffer persists across steps); as in real
decoding, each step one sequence in 16 gets a changed block table (a new block every 16
tokens), so those rows are rebuilt. Bare and plan rounds alternate; the best round of each
is reported (shared machines are noisy).
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
    out = ScheduledBatch()
    blocks_per_seq = -(-context // block_size)
    for i in range(batch):
        req = Request(str(i), [1] * (context - 1), SamplingParams(), i)
        seq = Sequence(i, req, [1] * context, context - 1, status=SeqStatus.RUNNING,
                       block_table=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                       num_computed_tokens=context - 1, block_table_version=i + 1)
        req.sequences.append(seq)
        out.seqs.append(seq)
        out.num_new_tokens.append(1)
        out.context_lens.append(context)
    return out


def worker(rank: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    channel = PlanChannel(dist.group.WORLD)
    batch = decode_batch(args.batch, args.context, 16)
    planner = Planner(16)
    stamps = count(args.batch + 1)  # block-table stamps are unique across sequences
    nbytes = len(encode_plan(planner.build(batch)[0]))
    bare = torch.zeros(nbytes, dtype=torch.uint8)
    timings: dict[str, float] = {}
    for name in ("bare", "plan") * (args.rounds + 1):  # the first pair is a warm-up
        dist.barrier()
        start = time.perf_counter()
        for step in range(args.steps):
            if name == "bare":
                dist.broadcast(bare, src=0)
            elif rank == 0:
                for seq in batch.seqs[step % 16::16]:
                    seq.block_table_version = next(stamps)  # as if it had just taken a new block
                channel.send(planner.build(batch)[0])
            else:
                channel.recv()
        dist.barrier()
        elapsed = (time.perf_counter() - start) / args.steps * 1e3
        timings[name] = elapsed if name not in timings else min(timings[name], elapsed)
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
        print(json.dumps(dict(results)))


if __name__ == "__main__":
    main()
