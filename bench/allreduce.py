"""All-reduce latency at the decode message size (hidden x batch x 2 bytes, bf16) with NCCL,
eager and inside a CUDA graph, NVLink multicast off. Run under torchrun:

    torchrun --standalone --nproc-per-node=2 bench/allreduce.py --hidden 4096 --batch 1
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(key, value)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=500)
    args = p.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    x = torch.ones(args.batch, args.hidden, dtype=torch.bfloat16, device="cuda")
    for _ in range(20):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - start) / args.iters * 1e6
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dist.all_reduce(x)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(100):
                dist.all_reduce(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters // 100 or 1):
        graph.replay()
    torch.cuda.synchronize()
    graph_us = (time.perf_counter() - start) / ((args.iters // 100 or 1) * 100) * 1e6
    if rank == 0:
        print(json.dumps({"world_size": dist.get_world_size(), "bytes": x.numel() * 2,
                          "eager_us": round(eager_us, 2), "in_graph_us": round(graph_us, 2)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
