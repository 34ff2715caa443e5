"""For ops teams choosing a TP degree: run one model at TP 1, 2, 4, 8 (as many GPUs as the
machine has; gloo on CPU) and write a markdown table and a PNG plot of batch-1 decode
tokens/s, per-GPU bandwidth efficiency, throughput, TTFT and KV memory per rank. The
efficiency's B is a device-to-device copy measured on the first device after the sweep
(bench/roofline.py), recorded in every row with the device's name.

    python bench/tp_sweep.py --model-config bench/configs/qwen3-32b.json --out docs/tp_sweep
    python bench/tp_sweep.py --model-config CFG --device cpu --tp 1,2 --num-seqs 4 --max-len 32 \
        --copy-bytes 16777216 --gemm-size 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(ROOT / "_checkout.py"))

from tapserve.bench import roofline  # noqa: E402

KEEP_NVLS_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def available_degrees(device: str | None) -> list[int]:
    import torch

    gpus = torch.cuda.device_count() if device != "cpu" else 8
    return [n for n in (1, 2, 4, 8) if n <= max(gpus, 1)]


def run_degree(tp: int, args, out_dir: Path) -> dict:
    out = out_dir / f"tp{tp}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={tp}",
        str(ROOT / "bench" / "tp_worker.py"),
        "--model-config",
        args.model_config,
        "--json",
        str(out),
        "--num-seqs",
        str(args.num_seqs),
        "--max-len",
        str(args.max_len),
        "--context",
        str(args.context),
        "--max-model-len",
        str(args.max_model_len),
        "--steps",
        str(args.steps),
    ]
    if args.device:
        cmd += ["--device", args.device]
    env = {**os.environ, **KEEP_NVLS_OFF, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, timeout=args.timeout)
    return json.loads(out.read_text())


def derive(row: dict, machine: dict) -> dict:
    """A worker's row with tokens/s and the efficiency against machine's measured B."""
    step_s = row["batch1_decode_ms"] / 1e3
    per_gpu_floor = row["batch1_read_bytes_per_rank"] / machine["copy_bytes_per_s"]
    return {
        **row,
        "device_name": machine["device_name"],
        "copy_bytes_per_s": machine["copy_bytes_per_s"],
        "bf16_flops_per_s": machine["bf16_flops_per_s"],
        "batch1_tokens_per_s": round(1 / step_s, 1),
        "per_gpu_bandwidth_efficiency": round(per_gpu_floor / step_s, 3),
    }


def table(rows: list[dict]) -> str:
    """The markdown table; "GPU ms" is the batch-1 step's GPU time alone (tp_worker's
    batch1_gpu_ms): the step ms above it are host time the engine did not hide."""
    head = (
        "| TP | batch-1 tok/s | step ms | GPU ms | per-GPU BW eff. | throughput tok/s "
        "| TTFT ms | KV GiB/rank |\n|---|---|---|---|---|---|---|---|\n"
    )
    return head + "".join(
        f"| {r['tp']} | {r['batch1_tokens_per_s']} | {r['batch1_decode_ms']} | "
        f"{r['batch1_gpu_ms']} | {r['per_gpu_bandwidth_efficiency']} | "
        f"{r['throughput_tokens_per_s']} | {r['ttft_ms']} | {r['kv_gib_per_rank']} |\n"
        for r in rows
    )


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = [r["tp"] for r in rows]
    panels = [
        ("batch1_tokens_per_s", "batch-1 decode tok/s"),
        ("per_gpu_bandwidth_efficiency", "per-GPU bandwidth efficiency"),
        ("throughput_tokens_per_s", "throughput tok/s"),
        ("ttft_ms", "TTFT (ms)"),
        ("kv_gib_per_rank", "KV GiB per rank"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (key, label) in zip(axes, panels):
        ax.plot(tps, [r[key] for r in rows], marker="o")
        ax.set_xticks(tps)
        ax.set_xlabel("TP degree")
        ax.set_title(label, fontsize=10)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-config", required=True)
    p.add_argument("--tp", help="comma-separated degrees (default: 1,2,4,8 up to the GPU count)")
    p.add_argument("--device")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed at batch 1")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--timeout", type=float, default=1800)
    roofline.add_arguments(p)
    p.add_argument(
        "--out", default="tp_sweep", help="output prefix: PREFIX.md, PREFIX.png, PREFIX.json"
    )
    args = p.parse_args()
    degrees = [int(x) for x in args.tp.split(",")] if args.tp else available_degrees(args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = [run_degree(tp, args, out.parent) for tp in tqdm(degrees, desc="TP degrees")]
    # measured once the workers are gone, so their memory is free
    device = args.device or ("cuda" if roofline.torch.cuda.is_available() else "cpu")
    machine = roofline.measure(device, args.copy_bytes, args.gemm_size)
    print(roofline.describe(machine))
    rows = [derive(r, machine) for r in raw]
    name = Path(args.model_config).stem
    out.with_suffix(".md").write_text(
        f"TP sweep, {name}; {roofline.describe(machine)}\n\n" + table(rows)
    )
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    plot(rows, out.with_suffix(".png"), f"tapserve TP sweep, {name}")
    print(table(rows))


if __name__ == "__main__":
    main()
