"""Paged decode attention alone (model/kernels/decode.py): KV bandwidth per batch size and
context, for the split counts and launch configs it can take.

Each timing replays a CUDA graph of one call per copy of the batch's block tables, each copy
on pages of its own (>= 512 MB of KV in all, to overflow the L2 cache, as a decode step reads
36 layers' KV). Bandwidth counts the K and V bytes the call must read. A context given as
`LO-HI` draws each sequence's length uniformly from [LO, HI] (seed 0), as the nano-vllm
workload's sequences have. Stage 1 sweeps --splits at the kernel's default launch config;
stage 2 tries --configs at the best few split counts of stage 1. `policy` is what the
backend picks for the batch (model/triton_backend.py) at --max-model-len. --orders times the
programs launched longest context first (as the backend launches them) and/or in batch order.

    python bench/decode_attention.py --model-config bench/configs/qwen3-8b.json \\
        --batch-sizes 1,16,64,128,256 --contexts 1024,100-2048 --max-model-len 4096
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

import torch

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.bench.kernel_timing import rank_heads, seconds_per_replay  # noqa: E402
from tapserve.model.kernels.decode import (  # noqa: E402
    decode_config,
    longest_first,
    make_decode_workspace,
    paged_decode_attention,
)
from tapserve.model.triton_backend import decode_split_policy  # noqa: E402

L2_FLUSH_BYTES = 512 << 20
Config = tuple[int, int, int]  # BLOCK_N, num_warps, num_stages


class Case:
    """One batch's query, context lengths and `copies` block tables over distinct pages."""

    def __init__(
        self,
        heads: int,
        kv_heads: int,
        head_dim: int,
        page: int,
        batch: int,
        context: str,
        seed: int = 0,
    ):
        rng = random.Random(seed)
        lo, _, hi = context.partition("-")
        lens = [rng.randint(int(lo), int(hi or lo)) for _ in range(batch)]
        self.kv_bytes = sum(lens) * kv_heads * head_dim * 2 * 2  # K and V, bf16
        blocks_per_seq = -(-max(lens) // page)
        self.copies = max(2, -(-L2_FLUSH_BYTES // self.kv_bytes))
        num_blocks = self.copies * batch * blocks_per_seq
        shape = (num_blocks, page, kv_heads, head_dim)
        self.k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        pages = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
        self.tables = pages.view(self.copies, batch, blocks_per_seq)
        self.lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
        self.q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)
        self.scale = head_dim**-0.5
        self.order: torch.Tensor | None = None  # seq_order: None is batch order

    def run(
        self,
        copy: int,
        splits: int,
        config: Config | None,
        workspace: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        return paged_decode_attention(
            self.q,
            self.k,
            self.v,
            self.tables[copy],
            self.lens,
            self.scale,
            out=self.out,
            num_kv_splits=splits,
            workspace=workspace,
            config=config,
            seq_order=self.order,
        )

    def seconds_per_call(self, splits: int, config: Config | None, replays: int = 10) -> float:
        q = self.q
        workspace = make_decode_workspace(q.shape[0], q.shape[1], q.shape[2], splits, q.device)
        return (
            seconds_per_replay(
                lambda: [self.run(c, splits, config, workspace) for c in range(self.copies)],
                replays,
            )
            / self.copies
        )


def parse_config(text: str) -> Config:
    block_n, warps, stages = (int(v) for v in text.split("x"))
    return block_n, warps, stages


def timed(case: Case, splits: int, config: Config | None, reference: torch.Tensor) -> dict:
    """One timing row, with the output's largest difference from the policy's."""
    seconds = case.seconds_per_call(splits, config)
    error = (case.run(0, splits, config, None).float() - reference.float()).abs().max()
    return {
        "splits": splits,
        "config": "x".join(map(str, config or decode_config(2))),
        "us": round(seconds * 1e6, 2),
        "tb_s": round(case.kv_bytes / seconds / 1e12, 3),
        "max_err": round(float(error), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-config", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--batch-sizes", default="1,16,64,128,256")
    p.add_argument("--contexts", default="1024,100-2048")
    p.add_argument("--max-model-len", type=int, default=4096, help="for the backend's policy")
    p.add_argument("--splits", default="1,2,4,8,16,32,64")
    p.add_argument(
        "--configs",
        default="64x4x2,64x4x3,64x8x2,128x4x2,128x8x2,128x8x3,32x4x2",
        help="BLOCK_Nxwarpsxstages, tried at stage 1's best --top",
    )
    p.add_argument("--top", type=int, default=3)
    p.add_argument(
        "--orders",
        default="longest-first",
        help="program launch orders to time: longest-first (the backend's), batch",
    )
    p.add_argument("--json", help="write every timing to this file")
    args = p.parse_args()
    heads, kv_heads, head_dim = rank_heads(json.loads(Path(args.model_config).read_text()), args.tp)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    policy = decode_split_policy(args.max_model_len, num_sms)
    rows = []
    for batch, context in itertools.product(
        map(int, args.batch_sizes.split(",")), args.contexts.split(",")
    ):
        case = Case(heads, kv_heads, head_dim, args.page, batch, context)
        policy_splits = policy(batch, kv_heads)
        reference = case.run(0, policy_splits, None, None).clone()
        for order in args.orders.split(","):
            case.order = longest_first(case.lens) if order == "longest-first" else None
            now = timed(case, policy_splits, None, reference)
            stage1 = [timed(case, s, None, reference) for s in map(int, args.splits.split(","))]
            best = sorted(stage1, key=lambda r: r["us"])[: args.top]
            stage2 = [
                timed(case, r["splits"], parse_config(c), reference)
                for r in best
                for c in args.configs.split(",")
            ]
            winner = min(stage1 + stage2, key=lambda r: r["us"])
            key = {"batch": batch, "context": context, "order": order}
            rows += [{**key, **r} for r in [now] + stage1 + stage2]
            print(
                json.dumps(
                    {
                        **key,
                        "policy": now,
                        "best": winner,
                        "us_by_splits": {r["splits"]: r["us"] for r in stage1},
                    }
                ),
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
