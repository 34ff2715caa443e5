"""Run under torchrun on 2+ GPUs: `allreduce_check.py OUT.json staged|fused`. The
symmetric-memory one-shot all-reduce (model/allreduce.py, through TPGroup.all_reduce) against
NCCL on random tensors, eager and replayed in CUDA graphs; rank 0 writes one JSON row per case.
tests/gpu/test_gpu_allreduce.py checks them."""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

runpy.run_path(str(Path(__file__).resolve().parents[2] / "_checkout.py"))

from tapserve.model.allreduce import _FUSED, _STAGED, SymmMemAllReduce, _op_matches  # noqa: E402
from tapserve.model.layers import TPGroup  # noqa: E402

MAX_BYTES = 1 << 20
# (dtype, numel, one-shot expected): 1001 bf16 is not 16-byte sized, 1 << 20 bf16 is over
# MAX_BYTES and float16 has no one-shot kernel: those take NCCL through the same call
CASES = (
    [(torch.bfloat16, n, True) for n in (8, 4096, 5120, 64 * 4096, 64 * 5120)]
    + [(torch.float32, n, True) for n in (16, 4096, 5120, 64 * 4096)]
    + [
        (torch.bfloat16, 1001, False),
        (torch.bfloat16, 1 << 20, False),
        (torch.float16, 4096, False),
    ]
)
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def random(numel: int, dtype: torch.dtype, seed: int, rank: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
    x = torch.randn(numel, generator=gen, device="cuda").to(dtype)
    return x.view(-1, 64) if numel % 64 == 0 else x


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Against NCCL's answer, and the same bits on every rank."""
    tol = TOL[out.dtype]
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, out)
    return {
        "close": torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol),
        "equal": torch.equal(out, ref),
        "max_abs_diff": (out.float() - ref.float()).abs().max().item(),
        "same_on_all_ranks": all(torch.equal(p, parts[0]) for p in parts),
    }


def combined(rows: list[dict]) -> dict:
    """One case's trials as one row: every flag must hold in all; the largest difference."""
    return {
        k: all(r[k] for r in rows) if k != "max_abs_diff" else max(r[k] for r in rows)
        for k in rows[0]
    }


def eager_case(tp: TPGroup, dtype: torch.dtype, numel: int, seed: int, rank: int) -> dict:
    x = random(numel, dtype, seed, rank)
    ref, out = x.clone(), x.clone()
    dist.all_reduce(ref)
    tp.all_reduce(out)
    return compare(out, ref)


def graph_case(tp: TPGroup, dtype: torch.dtype, numel: int, seed: int, rank: int) -> dict:
    """One captured all-reduce, replayed on three fresh inputs with NCCL calls in between."""
    static = torch.zeros_like(random(numel, dtype, seed, rank))
    tp.all_reduce(static)  # warm-up (NCCL communicator for the fallback cases)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tp.all_reduce(static)
    rows = []
    for trial in range(3):
        x = random(numel, dtype, seed * 10 + trial, rank)
        static.copy_(x)
        graph.replay()
        dist.all_reduce(x)
        rows.append(compare(static, x))
    return combined(rows)


def direct_case(tp: TPGroup, dtype: torch.dtype, numel: int, seed: int, rank: int) -> dict:
    """A message written straight into the buffer (TPGroup.partial_sums, as a row-parallel
    linear does), summed where it lies: eager, then captured and replayed on fresh inputs."""
    x = random(numel, dtype, seed, rank)
    staged = tp.partial_sums(tuple(x.shape), dtype)
    staged.copy_(x)
    out = tp.all_reduce(staged)
    ref = x.clone()
    dist.all_reduce(ref)
    rows = [{**compare(out, ref), "apart": out.data_ptr() != staged.data_ptr()}]
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static_out = tp.all_reduce(staged)
    for trial in range(3):
        x = random(numel, dtype, seed * 10 + trial, rank)
        staged.copy_(x)
        graph.replay()
        dist.all_reduce(x)
        apart = static_out.data_ptr() != staged.data_ptr()
        rows.append({**compare(static_out, x), "apart": apart})
    return combined(rows)


def row_parallel_case(tp: TPGroup, rank: int) -> dict:
    """A bf16 RowParallelLinear at batch 1 (the Triton GEMV, under PDL where the GPU has
    it), three in a chain as o and down follow each other, eager and replayed in a graph:
    each GEMV stores its partial sums in the one-shot buffer (checked after a lone call) and
    the sums equal the same layers on NCCL bit for bit."""
    from tapserve.model.layers import RowParallelLinear, linear

    gen = torch.Generator(device="cuda").manual_seed(rank)
    layers = []
    for _ in range(3):
        layer = RowParallelLinear(4096 * tp.size, 4096, tp).to("cuda", torch.bfloat16)
        layer.weight.data = (
            torch.randn(4096, 4096, generator=gen, device="cuda", dtype=torch.bfloat16) / 64
        )
        layers.append(layer)
    x = torch.randn(1, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)

    def chain(x: torch.Tensor, with_tp: TPGroup) -> torch.Tensor:
        for layer in layers:
            layer.tp = with_tp
            x = layer(x) / 8
        return x

    layers[0](x)
    lands = tp.partial_sums((1, 4096), torch.bfloat16)  # the GEMV's own output, in place
    in_buffer = torch.equal(lands, linear(x, layers[0].weight))
    plain = dataclasses.replace(tp, one_shot=None)
    ref = chain(x, plain)
    rows = [compare(chain(x, tp), ref)]
    static_x = x.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_x, tp)
    for _ in range(3):
        static_x.copy_(torch.randn(1, 4096, generator=gen, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        rows.append(compare(static_out, chain(static_x, plain)))
    return {
        "in_buffer": in_buffer,
        "equal": all(r["equal"] for r in rows),
        "same_on_all_ranks": all(r["same_on_all_ranks"] for r in rows),
    }


def chain_case(tp: TPGroup, rank: int) -> dict:
    """Back-to-back one-shot calls of different sizes in one graph, each feeding the next
    (the buffer is reused at once, as the decoder's layers do), against the same ops on NCCL."""

    def body(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, reduce) -> None:
        reduce(a)
        b[:64].add_(a)  # a: [64, 64], b: [4096, 64], c: [16]
        reduce(b)
        c.add_(b[:1].sum())
        reduce(c)

    inputs = [
        random(64 * 64, torch.bfloat16, 7, rank),
        random(64 * 4096, torch.bfloat16, 8, rank),
        random(16, torch.bfloat16, 9, rank),
    ]
    static = [torch.zeros_like(t) for t in inputs]
    body(*static, tp.all_reduce)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body(*static, tp.all_reduce)
    for s, t in zip(static, inputs):
        s.copy_(t)
    graph.replay()
    ref = [t.clone() for t in inputs]
    body(*ref, dist.all_reduce)
    rows = [compare(s, r) for s, r in zip(static, ref)]
    return {
        "close": all(r["close"] for r in rows),
        "same_on_all_ranks": all(r["same_on_all_ranks"] for r in rows),
    }


def main(out_file: str, variant: str) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=device)
    fused = variant == "fused"
    available = _op_matches(*(_FUSED if fused else _STAGED))
    comm = (
        SymmMemAllReduce.create(dist.group.WORLD, device, MAX_BYTES, fused) if available else None
    )
    result = {
        "available": available,
        "set_up": comm is not None,
        "torch": torch.__version__,
        "cases": [],
    }
    if comm is not None:
        tp = TPGroup(
            rank=dist.get_rank(), size=dist.get_world_size(), group=dist.group.WORLD, one_shot=comm
        )
        for seed, (dtype, numel, expected) in enumerate(CASES):
            probe = random(numel, dtype, 0, rank)
            runs = [("eager", eager_case), ("graph", graph_case)]
            if tp.partial_sums(tuple(probe.shape), dtype) is not None:
                runs.append(("direct", direct_case))
            for mode, run in runs:
                row = run(tp, dtype, numel, seed, rank)
                result["cases"].append(
                    {
                        "dtype": str(dtype),
                        "numel": numel,
                        "mode": mode,
                        "one_shot": comm.eligible(probe),
                        "expected_one_shot": expected,
                        **row,
                    }
                )
        result["chain"] = chain_case(tp, rank)
        if not fused:
            result["row_parallel"] = row_parallel_case(tp, rank)
    torch.cuda.synchronize()
    if rank == 0:
        Path(out_file).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
