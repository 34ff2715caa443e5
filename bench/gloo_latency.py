"""How long one gloo broadcast of a plan-sized message takes when the receiver has waited
idle for a while (as rank 1 waits while rank 0's GPU runs a synchronous step), against
broadcasts that follow each other back to back.

    torchrun --standalone --nproc-per-node=2 bench/gloo_latency.py [--bytes 16384] [--gaps-ms 0,0.5,4]

Rank 0 spins for the gap, then broadcasts; each rank notes when its call returns
(time.perf_counter_ns: one clock for the processes of a host). Prints, per gap, the median
µs until rank 0's call returns and until rank 1 holds the bytes, after rank 0's call starts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

ns = time.perf_counter_ns


def rounds(buffer: torch.Tensor, gap_ns: int, count: int) -> list[tuple[int, ...]]:
    marks = []
    for _ in range(count):
        if dist.get_rank() == 0:
            start = ns()
            while ns() - start < gap_ns:
                pass
            sent = ns()
            dist.broadcast(buffer, src=0)
            marks.append((sent, ns()))
        else:
            dist.broadcast(buffer, src=0)
            marks.append((ns(),))
    return marks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=16384)
    p.add_argument("--gaps-ms", default="0,0.5,4")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    dist.init_process_group("gloo")
    buffer = torch.zeros(args.bytes, dtype=torch.uint8)
    for gap in (float(g) for g in args.gaps_ms.split(",")):
        marks = rounds(buffer, int(gap * 1e6), args.rounds)[args.warmup :]
        both = [None] * dist.get_world_size()
        dist.all_gather_object(both, marks)
        if dist.get_rank() == 0:
            sends = [(end - start) / 1e3 for start, end in both[0]]
            holds = [(got[0] - start) / 1e3 for (start, _), got in zip(both[0], both[1])]
            print(
                f"gap {gap} ms: send returns {statistics.median(sends):.0f} µs, "
                f"rank 1 holds the bytes {statistics.median(holds):.0f} µs"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
