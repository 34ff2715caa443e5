"""Few-row linears (decode at small batch): the Triton GEMV (model/kernels/gemv.py) against
cuBLAS (F.linear), in bandwidth over the weight bytes.

Each timing replays a CUDA graph that runs the op over enough distinct copies of the weight
to overflow the L2 cache (>= 512 MB in all), as a decode step streams its layers' weights.
`--sweep` tries every launch config at M = 1 and the best few at larger M, and prints the
best per shape; without it, the configs the kernel uses (gemv_config) are timed.

    python bench/gemv.py --model-config bench/configs/qwen3-8b.json --tp 1,2 --rows 1,2,4,8
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_timing import rank_heads, seconds_per_replay  # noqa: E402
from model.kernels.gemv import DEFAULT_CONFIG, GemvConfig, gemv, gemv_config  # noqa: E402
from model.layers import GEMV_MAX_ROWS  # noqa: E402

L2_FLUSH_BYTES = 512 << 20


def linear_shapes(config: dict, tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear of one rank's layer, and the LM head's."""
    hidden = config["hidden_size"]
    heads, kv_heads, head_dim = rank_heads(config, tp)
    q, kv = heads * head_dim, kv_heads * head_dim
    inter = config["intermediate_size"] // tp
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (math.ceil(config["vocab_size"] / tp), hidden)}


def time_per_call(op, weights: list[torch.Tensor], replays: int = 20) -> float:
    """Seconds per op call, from a CUDA graph of one call per weight copy."""
    return seconds_per_replay(lambda: [op(w) for w in weights], replays,
                              warm_replays=3) / len(weights)


def configs_to_sweep(rows: int) -> list[GemvConfig]:
    out = []
    for bn, bk, warps, stages in itertools.product((4, 8, 16, 32), (128, 256, 512, 1024),
                                                   (2, 4, 8), (1, 3)):
        per_thread = triton.next_power_of_2(rows) * bn * bk // (32 * warps)  # fp32 accumulator
        if 8 <= per_thread <= 128:
            out.append(GemvConfig(bn, bk, warps, stages))
    return out


def measure(name: str, n: int, k: int, rows: list[int], sweep: bool, top: int) -> list[dict]:
    nbytes = n * k * 2
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(max(2, -(-L2_FLUSH_BYTES // nbytes)))]
    results, ranked = [], None
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, weights[0])
        cublas = time_per_call(lambda w: F.linear(x, w), weights)
        if sweep:
            if ranked is None:
                candidates = configs_to_sweep(1)
            else:
                fitting = configs_to_sweep(m)
                candidates = [c for c in ranked[:top] if c in fitting] or [DEFAULT_CONFIG]
        else:  # the layers' choice; where that is cuBLAS, the default config for comparison
            candidates = [gemv_config(n, k, m) or DEFAULT_CONFIG]
        timed = []
        for cfg in candidates:
            err = (gemv(x, weights[0], config=cfg).float() - ref.float()).abs().max().item()
            if err > 0.05 * ref.float().abs().max().item() + 1e-2:
                raise AssertionError(f"{name} {cfg}: max error {err}")
            timed.append((time_per_call(lambda w: gemv(x, w, config=cfg), weights), cfg))
        timed.sort(key=lambda t: t[0])
        if ranked is None:
            ranked = [c for _, c in timed]
        best_s, best = timed[0]
        row = {"linear": name, "n": n, "k": k, "rows": m, "cublas_tbs": nbytes / cublas / 1e12,
               "gemv_tbs": nbytes / best_s / 1e12, "cublas_us": cublas * 1e6,
               "gemv_us": best_s * 1e6, "config": vars(best),
               "layers_use": "gemv" if m <= GEMV_MAX_ROWS and gemv_config(n, k, m) else "cublas"}
        print(json.dumps(row), flush=True)
        results.append(row)
    del weights
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", action="append", required=True)
    parser.add_argument("--tp", default="1")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--top", type=int, default=6, help="configs tried at M > 1 (--sweep)")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    out = []
    for path in args.model_config:
        config = json.loads(Path(path).read_text())
        for tp in (int(t) for t in args.tp.split(",")):
            for name, (n, k) in linear_shapes(config, tp).items():
                tag = f"{Path(path).stem} tp{tp} {name}"
                out += measure(tag, n, k, rows, args.sweep, args.top)
    print(f"{'linear':32} {'M':>2} {'cuBLAS TB/s':>11} {'gemv TB/s':>9} {'layers use':>10}  config")
    for r in out:
        print(f"{r['linear']:32} {r['rows']:>2} {r['cublas_tbs']:11.2f} {r['gemv_tbs']:9.2f} "
              f"{r['layers_use']:>10}  {r['config']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
