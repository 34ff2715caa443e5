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
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F
import triton

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.bench.kernel_timing import rank_heads, seconds_per_replay  # noqa: E402
from tapserve.model.kernels.gemv import DEFAULT_CONFIG, GemvConfig, gemv, gemv_config, parse_shape  # noqa: E402
from tapserve.model.layers import GEMV_MAX_ROWS  # noqa: E402

L2_FLUSH_BYTES = 512 << 20


def linear_shapes(config: dict, tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear of one rank's layer, and the LM head's."""
    hidden = config["hidden_size"]
    heads, kv_heads, head_dim = rank_heads(config, tp)
    q, kv = heads * head_dim, kv_heads * head_dim
    inter = config["intermediate_size"] // tp
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "lm_head": (math.ceil(config["vocab_size"] / tp), hidden),
    }


def time_per_call(op, weights: list[torch.Tensor], replays: int = 20) -> float:
    """Seconds per op call, from a CUDA graph of one call per weight copy."""
    return seconds_per_replay(lambda: [op(w) for w in weights], replays, warm_replays=3) / len(
        weights
    )


Space = Mapping[str, tuple[int, ...]]
SWEEP_SPACE: Space = MappingProxyType(
    {
        "block_n": (4, 8, 16, 32),
        "block_k": (128, 256, 512, 1024),
        "warps": (2, 4, 8),
        "stages": (1, 3),
        "reduce_each": (0,),
    }
)


def configs_to_sweep(rows: int, space: Space = SWEEP_SPACE) -> list[GemvConfig]:
    """The configs of the space whose per-thread tile fits the registers at `rows` rows: a
    thread's products per tile (rows x its weight elements) between 8 and 128, or 256 with
    reduce_each, whose products are summed at once instead of kept as accumulators."""
    out = []
    for bn, bk, warps, stages, each in itertools.product(
        space["block_n"], space["block_k"], space["warps"], space["stages"], space["reduce_each"]
    ):
        per_thread = triton.next_power_of_2(rows) * bn * bk // (32 * warps)
        if 8 <= per_thread <= (256 if each else 128):
            out.append(GemvConfig(bn, bk, warps, stages, bool(each)))
    return out


def _compile(configs: list[GemvConfig], ks: list[int]) -> int:
    """Compile (into Triton's on-disk cache) the kernels of these configs at one row."""
    for cfg in configs:
        for k in ks:
            gemv(
                torch.ones(1, k, device="cuda", dtype=torch.bfloat16),
                torch.ones(64, k, device="cuda", dtype=torch.bfloat16),
                config=cfg,
            )
    torch.cuda.synchronize()
    return len(configs)


def precompile(configs: list[GemvConfig], ks: list[int], workers: int) -> None:
    """Fill Triton's cache from `workers` processes, so that a sweep does not compile its
    configs one after another on the GPU machine's clock."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    chunks = [configs[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_compile, chunks, [ks] * workers))


def measure(
    name: str, n: int, k: int, rows: list[int], sweep: bool, top: int, space: Space = SWEEP_SPACE
) -> list[dict]:
    nbytes = n * k * 2
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for _ in range(max(2, -(-L2_FLUSH_BYTES // nbytes)))
    ]
    results, ranked = [], None
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, weights[0])
        cublas = time_per_call(lambda w: F.linear(x, w), weights)
        if sweep:
            if ranked is None:
                candidates = configs_to_sweep(1, space)
            else:
                fitting = configs_to_sweep(m, space)
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
        row = {
            "linear": name,
            "n": n,
            "k": k,
            "rows": m,
            "cublas_tbs": nbytes / cublas / 1e12,
            "gemv_tbs": nbytes / best_s / 1e12,
            "cublas_us": cublas * 1e6,
            "gemv_us": best_s * 1e6,
            "config": vars(best),
            "layers_use": "gemv" if m <= GEMV_MAX_ROWS and gemv_config(n, k, m) else "cublas",
            "runners_up": [[round(nbytes / s / 1e12, 3), vars(c)] for s, c in timed[1:top]],
        }
        print(json.dumps(row), flush=True)
        results.append(row)
    del weights
    torch.cuda.empty_cache()
    return results


def write_configs(path: Path, rows: list[dict], command: str) -> None:
    """Merge each shape's fastest kernel at one row into the table at path: the best config's
    fields, or {"cublas": true} where cuBLAS beat it; with the bandwidths measured and the
    command that measured them. Linears of one shape (two models' o) keep the faster row."""
    table = json.loads(path.read_text()) if path.exists() else {"sources": [], "configs": {}}
    source = f"python bench/gemv.py {command} (on {torch.cuda.get_device_name()})"
    if source not in table["sources"]:
        table["sources"].append(source)
    best: dict[str, dict] = {}
    for r in rows:
        shape = f"{r['n']}x{r['k']}"
        if r["rows"] == 1 and (shape not in best or r["gemv_tbs"] > best[shape]["gemv_tbs"]):
            best[shape] = r
    for shape, r in best.items():
        kernel = r["config"] if r["gemv_tbs"] > r["cublas_tbs"] else {"cublas": True}
        table["configs"][shape] = {
            **kernel,
            "tbs": round(r["gemv_tbs"], 3),
            "cublas_tbs": round(r["cublas_tbs"], 3),
            "linear": r["linear"],
        }
    lines = [
        f' "{shape}": {json.dumps(table["configs"][shape])}'
        for shape in sorted(table["configs"], key=parse_shape)
    ]
    path.write_text(
        '{"sources": '
        + json.dumps(table["sources"], indent=1)
        + ',\n"configs": {\n'
        + ",\n".join(lines)
        + "\n}}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", action="append", required=True)
    parser.add_argument("--tp", default="1")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--top", type=int, default=6, help="configs tried at M > 1 (--sweep)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument(
        "--linears", default="qkv,o,gate_up,down,lm_head", help="which of a layer's linears to time"
    )
    parser.add_argument(
        "--write-configs",
        metavar="PATH",
        help="--sweep: merge the best config per shape at one row into this "
        "table (model/kernels/gemv_configs.json is the layers')",
    )
    parser.add_argument(
        "--precompile",
        type=int,
        default=0,
        help="--sweep: compile the configs first in this many processes",
    )
    for key, values in SWEEP_SPACE.items():
        parser.add_argument(
            f"--{key.replace('_', '-')}",
            default=",".join(map(str, values)),
            help=f"--sweep: the {key} values tried",
        )
    args = parser.parse_args()
    space = {key: tuple(int(v) for v in getattr(args, key).split(",")) for key in SWEEP_SPACE}
    linears = set(args.linears.split(","))
    shapes = {
        f"{Path(path).stem} tp{tp} {name}": shape  # every linear timed, by its tag
        for path in args.model_config
        for tp in map(int, args.tp.split(","))
        for name, shape in linear_shapes(json.loads(Path(path).read_text()), tp).items()
        if name in linears
    }
    if args.sweep and args.precompile:
        ks = sorted({k for _, k in shapes.values()})
        precompile(configs_to_sweep(1, space), ks, args.precompile)
    rows = [int(r) for r in args.rows.split(",")]
    out = []
    for tag, (n, k) in shapes.items():
        out += measure(tag, n, k, rows, args.sweep, args.top, space)
    print(f"{'linear':32} {'M':>2} {'cuBLAS TB/s':>11} {'gemv TB/s':>9} {'layers use':>10}  config")
    for r in out:
        print(
            f"{r['linear']:32} {r['rows']:>2} {r['cublas_tbs']:11.2f} {r['gemv_tbs']:9.2f} "
            f"{r['layers_use']:>10}  {r['config']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if args.sweep and args.write_configs:
        write_configs(Path(args.write_configs), out, " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
