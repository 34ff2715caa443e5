"""Time of the Triton temperature-sampling kernel (model/kernels/sample.py) next to torch's
argmax over the same float32 logits (what a greedy batch costs).

    python bench/sample_kernel.py [--vocab 151936] [--rows 1,64,256] [--splits auto,1,8]
                                  [--block 2048]

Prints one JSON line per case: the median over --iters calls, timed with CUDA events around
each call ("us": launch included, so small cases show the host's launch cost) and over
--iters back-to-back calls ("us_queued": one wait at the end; the GPU time when the GPU is
the bottleneck) and over CUDA-graph replays ("us_graph": the GPU's time alone, no launch
cost). --splits and --block pick the kernel's chunks per row ("auto": its own choice) and
loop block; "same" says whether the tokens equal those of one chunk a row (the unsplit
kernel's), as they must.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.model.kernels.sample import gumbel_sample  # noqa: E402


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


def graph_us(fn, iters: int, per_graph: int = 20) -> float:
    """GPU time alone: `per_graph` calls captured in one CUDA graph, its replays timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    return gpu_us(graph.replay, max(1, iters // per_graph)) / per_graph


def timings(fn, iters: int) -> dict[str, float]:
    return {
        "us": round(gpu_us(fn, iters), 1),
        "us_queued": round(queued_us(fn, iters), 1),
        "us_graph": round(graph_us(fn, iters), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--rows", default="1,64,256")
    p.add_argument("--splits", default="auto", help="comma list of chunks a row (at most) or auto")
    p.add_argument("--block", default="2048", help="comma list of loop blocks (powers of two)")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    splits = [None if s == "auto" else int(s) for s in args.splits.split(",")]
    for rows in map(int, args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, device="cuda")
        temps = torch.full((rows,), 0.6, device="cuda")
        case = {"rows": rows, "vocab": args.vocab, "dtype": "float32"}
        argmax = timings(lambda: logits.argmax(-1), args.iters)
        print(json.dumps({**case, "op": "torch argmax", **argmax}))
        unsplit = gumbel_sample(logits, temps, 1, _splits=1)
        for block in map(int, args.block.split(",")):
            for n in splits:
                fn = lambda: gumbel_sample(logits, temps, 1, _splits=n, _block=block)  # noqa: E731
                same = bool(torch.equal(fn(), unsplit))
                print(
                    json.dumps(
                        {
                            **case,
                            "op": "gumbel_sample",
                            "splits": n or "auto",
                            "block": block,
                            "same": same,
                            **timings(fn, args.iters),
                        }
                    )
                )


if __name__ == "__main__":
    main()
