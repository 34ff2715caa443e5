"""Time of the Triton temperature-sampling kernel (model/kernels/sample.py) next to torch's
argmax over the same float32 logits (what a greedy batch costs).

    python bench/sample_kernel.py [--vocab 151936] [--rows 1,64,256]

Prints one JSON line per case: the median over --iters calls, timed with CUDA events around
each call ("us": launch included, so small cases show the host's launch cost) and over
--iters back-to-back calls ("us_queued": one wait at the end; the GPU time when the GPU is
the bottleneck).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.kernels.sample import gumbel_sample  # noqa: E402


def gpu_us(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def queued_us(fn, iters: int) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", default="1,64,256")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    for rows in map(int, args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, device="cuda")
        temps = torch.full((rows,), 0.6, device="cuda")
        case = {"rows": rows, "vocab": args.vocab, "dtype": "float32"}
        for op, fn in (("torch argmax", lambda: logits.argmax(-1)),
                       ("gumbel_sample", lambda: gumbel_sample(logits, temps, 1))):
            print(json.dumps({**case, "op": op, "us": round(gpu_us(fn, args.iters), 1),
                              "us_queued": round(queued_us(fn, args.iters), 1)}))


if __name__ == "__main__":
    main()
