"""The machine's own roofline (DESIGN.md "Reference workloads"): B, the bandwidth of a
device-to-device copy, and F, the throughput of a bf16 GEMM, both measured in the run that
uses them; a step's floor is max(bytes / B, FLOPs / F).

    python bench/roofline.py                      # cuda if available: 1 GiB copy, 8192^3 GEMM
    python bench/roofline.py --device cpu --copy-bytes 16777216 --gemm-size 256
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable

import torch

COPY_BYTES = 1 << 30
GEMM_SIZE = 8192
REPEATS = 10


def _best_seconds(work: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The shortest of `repeats` timed calls of `work`, after one untimed call (first touch of
    the memory, kernel selection). CUDA events on a GPU, the wall clock elsewhere."""
    work()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            work()
            best = min(best, time.perf_counter() - started)
    return best


def measure_copy_bandwidth(
    device: str | torch.device, nbytes: int = COPY_BYTES, repeats: int = REPEATS
) -> float:
    """Bytes per second of a device-to-device copy of `nbytes` (best of `repeats`), counting
    the bytes read plus the bytes written (2 x nbytes per copy): the convention under which
    decode_sweep's "bytes read per step / B" is a step's floor."""
    device = torch.device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / seconds


def measure_bf16_flops(
    device: str | torch.device, size: int = GEMM_SIZE, repeats: int = REPEATS
) -> float:
    """FLOP/s of a bf16 GEMM of size x size by size x size (2 size^3 FLOPs), best of
    `repeats`."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=g, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, generator=g, device=device, dtype=torch.bfloat16)
    out = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), device, repeats)
    return 2 * size**3 / seconds


def step_floor(nbytes: float, flops: float, bytes_per_s: float, flops_per_s: float) -> float:
    """A step's floor in seconds: max(bytes / B, FLOPs / F)."""
    return max(nbytes / bytes_per_s, flops / flops_per_s)


def device_name(device: str | torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()})"


def measure(
    device: str | torch.device, copy_bytes: int = COPY_BYTES, gemm_size: int = GEMM_SIZE
) -> dict:
    """B and F of `device` with the device's name, as recorded beside a benchmark's figures;
    the buffers are freed (and CUDA's cache emptied) before it returns."""
    figures = {
        "device_name": device_name(device),
        "copy_bytes": copy_bytes,
        "copy_bytes_per_s": measure_copy_bandwidth(device, copy_bytes),
        "gemm_size": gemm_size,
        "bf16_flops_per_s": measure_bf16_flops(device, gemm_size),
    }
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--copy-bytes and --gemm-size (smaller ones for a quick run on a CPU)."""
    parser.add_argument(
        "--copy-bytes",
        type=int,
        default=COPY_BYTES,
        help="bytes of the device-to-device copy that measures B (default 1 GiB)",
    )
    parser.add_argument(
        "--gemm-size",
        type=int,
        default=GEMM_SIZE,
        help="N of the N x N x N bf16 GEMM that measures F (default 8192)",
    )


def describe(figures: dict) -> str:
    return (
        f"{figures['device_name']}: copy {figures['copy_bytes_per_s'] / 1e12:.3f} TB/s "
        f"(read + written), bf16 GEMM {figures['bf16_flops_per_s'] / 1e12:.4g} TFLOP/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_arguments(p)
    args = p.parse_args()
    figures = measure(args.device, args.copy_bytes, args.gemm_size)
    print(describe(figures))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
