"""All-reduce latency at the decode message size (hidden x batch x 2 bytes, bf16) with NCCL,
eager and inside a CUDA graph, NVLink multicast off. Run under torchrun:

    torchrun --standalone --nproc-per-node=2 bench/allreduce.py --hidden 4096 --batch 1

--hidden and --batch take comma-separated lists (every combination is timed). With --symm,
each size is also timed with the symmetric-memory one-shot all-reduce (model/allreduce.py), as
"staged" (copy_ + one_shot_all_reduce_out: TAPSERVE_ALLREDUCE=symm) and "fused"
(one_shot_all_reduce_copy_out: symm_fused), eager and in a graph, and its result is checked
against NCCL's on random inputs (eager and replayed). One JSON line per size and
implementation; the NCCL line keeps its keys.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

for key, value in {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}.items():
    os.environ.setdefault(key, value)

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))


def time_all_reduce(
    reduce: Callable[[torch.Tensor], object], x: torch.Tensor, iters: int
) -> tuple[float, float]:
    """(eager µs, in-graph µs) per call: `iters` eager calls, then a graph of 100 calls
    replayed iters // 100 times."""
    for _ in range(20):
        reduce(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        reduce(x)
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - start) / iters * 1e6
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        reduce(x)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(100):
                reduce(x)
    torch.cuda.synchronize()
    replays = iters // 100 or 1
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return eager_us, (time.perf_counter() - start) / (replays * 100) * 1e6


def check_against_nccl(
    reduce: Callable[[torch.Tensor], object], shape: tuple[int, int], rank: int
) -> dict:
    """Random bf16 inputs: `reduce` eager and replayed from a graph vs dist.all_reduce."""

    def inputs(seed: int) -> torch.Tensor:
        gen = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
        return torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)

    x = inputs(0)
    ref, out = x.clone(), x.clone()
    dist.all_reduce(ref)
    reduce(out)
    pairs = [(out, ref)]
    static = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reduce(static)
    for seed in (1, 2):
        x = inputs(seed)
        static.copy_(x)
        graph.replay()
        dist.all_reduce(x)
        pairs.append((static.clone(), x))
    diff = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
    return {
        "matches_nccl": all(
            torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in pairs
        ),
        "bitwise_equal": all(torch.equal(a, b) for a, b in pairs),
        "max_abs_diff": diff,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", default="4096", help="comma-separated hidden sizes")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument(
        "--symm",
        action="store_true",
        help="also time the symmetric-memory one-shot all-reduce and check it",
    )
    args = p.parse_args()
    sizes = [
        (h, b) for h in map(int, args.hidden.split(",")) for b in map(int, args.batch.split(","))
    ]
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    comm, variants = None, []
    if args.symm:
        from tapserve.model.allreduce import _FUSED, _STAGED, SymmMemAllReduce, _op_matches

        variants = [v for v, op in (("staged", _STAGED), ("fused", _FUSED)) if _op_matches(*op)]
        comm = SymmMemAllReduce.create(
            dist.group.WORLD,
            device,
            max(h * b for h, b in sizes) * 2,
            fused=variants[:1] == ["fused"],
        )
        if comm is None:
            variants = []
            if rank == 0:
                print(json.dumps({"impl": "symm_one_shot", "error": "set-up failed (see log)"}))
    for hidden, batch in sizes:
        x = torch.ones(batch, hidden, dtype=torch.bfloat16, device="cuda")
        eager_us, graph_us = time_all_reduce(dist.all_reduce, x, args.iters)
        if rank == 0:
            print(
                json.dumps(
                    {
                        "world_size": world,
                        "bytes": x.numel() * 2,
                        "eager_us": round(eager_us, 2),
                        "in_graph_us": round(graph_us, 2),
                        "impl": "nccl",
                    }
                )
            )
        for variant in variants:
            comm.fused = variant == "fused"

            def one_shot(t: torch.Tensor) -> None:
                if comm.reduce(t) is None:
                    raise RuntimeError(f"{tuple(t.shape)} {t.dtype}: not a one-shot message")

            check = check_against_nccl(one_shot, (batch, hidden), rank)
            x = torch.ones(batch, hidden, dtype=torch.bfloat16, device="cuda")
            eager_us, graph_us = time_all_reduce(one_shot, x, args.iters)
            if rank == 0:
                print(
                    json.dumps(
                        {
                            "world_size": world,
                            "bytes": x.numel() * 2,
                            "eager_us": round(eager_us, 2),
                            "in_graph_us": round(graph_us, 2),
                            "impl": "symm_one_shot",
                            "variant": variant,
                            **check,
                        }
                    )
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
