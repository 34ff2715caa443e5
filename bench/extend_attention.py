"""Prefill/extend attention alone (model/kernels/extend.py, through the Triton backend): time
and TFLOP/s per batch shape, the backend's way (one-row sequences to the decode kernel) and
with every sequence through the extend kernel, and the extend kernel's launch configs.

Shapes, as the nano-vllm workload's prefill steps have them (lengths seeded):
  prefill  prompts of 100-1024 tokens (no cached prefix) up to --tokens in all
  mixed    the same plus --decode-rows one-row sequences with contexts of 100-1100 tokens
  long     one prompt of --long tokens
FLOPs count the causal product only (QK^T and PV over the keys each row sees).

    python bench/extend_attention.py --model-config bench/configs/qwen3-8b.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.bench.kernel_timing import rank_heads, seconds_per_replay  # noqa: E402
from tapserve.model.attention import AttentionMetadata  # noqa: E402
from tapserve.model.kernels import extend_attention  # noqa: E402
from tapserve.model.kernels.extend import extend_config, extend_work  # noqa: E402
from tapserve.model.triton_backend import make_triton_backend  # noqa: E402


def shapes(tokens: int, decode_rows: int, long: int) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query lengths, cached prefix lengths)."""
    rng = random.Random(0)
    prompts = []
    while sum(prompts) < tokens:
        prompts.append(min(rng.randint(100, 1024), tokens - sum(prompts)))
    decoding = [rng.randint(100, 1100) for _ in range(decode_rows)]
    return {
        "prefill": (prompts, [0] * len(prompts)),
        "mixed": (prompts + [1] * decode_rows, [0] * len(prompts) + [c - 1 for c in decoding]),
        "long": ([long], [0]),
    }


def make_meta(q_lens: list[int], prefix: list[int], page: int, device: str) -> AttentionMetadata:
    """Metadata over distinct, shuffled pages (the store is not timed: the cache is random)."""
    ctx = [p + q for p, q in zip(prefix, q_lens)]
    blocks = [-(-c // page) for c in ctx]
    pages = torch.randperm(sum(blocks), dtype=torch.int32)
    tables = torch.zeros(len(ctx), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = pages[used : used + n]
        used += n
    starts = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        is_decode=False,
        query_start_loc_host=starts,
        context_lens_host=ctx,
    )


def causal_flops(q_lens: list[int], prefix: list[int], heads: int, head_dim: int) -> float:
    keys = sum(q * p + q * (q + 1) / 2 for q, p in zip(q_lens, prefix))
    return 4 * heads * head_dim * keys


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-config", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--decode-rows", type=int, default=200)
    p.add_argument("--long", type=int, default=4096)
    p.add_argument(
        "--configs",
        default="64x64x8x2,64x64x4x2,128x64x8x2,128x32x8x2,64x32x4x2,128x64x8x3",
        help="BLOCK_MxBLOCK_Nxwarpsxstages for the extend kernel alone",
    )
    args = p.parse_args()
    heads, kv_heads, head_dim = rank_heads(json.loads(Path(args.model_config).read_text()), args.tp)
    cases = shapes(args.tokens, args.decode_rows, args.long)
    max_seqs = max(len(q_lens) for q_lens, _ in cases.values())
    backend = make_triton_backend(max_seqs, heads, head_dim, 8192, torch.device("cuda"))
    for name, (q_lens, prefix) in cases.items():
        meta = make_meta(q_lens, prefix, args.page, "cuda")
        num_blocks = int(meta.block_tables.max()) + 1
        cache = (num_blocks, args.page, kv_heads, head_dim)
        k = torch.randn(cache, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(cache, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(sum(q_lens), heads, head_dim, device="cuda", dtype=torch.bfloat16)
        scale = head_dim**-0.5
        flops = causal_flops(q_lens, prefix, heads, head_dim)
        row = {
            "shape": name,
            "seqs": len(q_lens),
            "tokens": sum(q_lens),
            "gflop": round(flops / 1e9, 2),
        }
        seconds = seconds_per_replay(lambda: backend.extend(q, k, v, meta, scale), 20)
        row["backend_ms"] = round(seconds * 1e3, 3)
        row["backend_tflops"] = round(flops / seconds / 1e12, 1)
        for config in [None] + [tuple(map(int, c.split("x"))) for c in args.configs.split(",")]:
            block_m = (config or extend_config(2, head_dim))[0]
            work = torch.from_numpy(extend_work(np.diff(meta.query_start_loc_host), block_m)).cuda()
            seconds = seconds_per_replay(
                lambda: extend_attention(
                    q,
                    k,
                    v,
                    meta.query_start_loc,
                    meta.context_lens,
                    meta.block_tables,
                    scale,
                    work=work,
                    config=config,
                ),
                20,
            )
            key = "x".join(map(str, config)) if config else "default"
            row[f"extend_only_{key}_ms"] = round(seconds * 1e3, 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
