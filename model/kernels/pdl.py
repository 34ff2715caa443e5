"""Programmatic dependent launch (PDL) for the decode path's kernels.

A batch-1 decode step is ~400 short kernels in a CUDA graph, and the GPU idles for a moment
between any two of them. Launched with PDL (Hopper and newer), a kernel is scheduled while
its predecessor still runs: every kernel here waits for its predecessor to finish (and its
writes to land) before it reads anything but constants (the GEMV reads its first weight
tile before the wait), and lets its own successor launch at once. A kernel finishes only
after its wait, so the chain stays transitive: no kernel reads what an earlier one has not
finished writing. Kernels of other libraries in between (cuBLAS, torch, NCCL) launch as
usual.

TAPSERVE_PDL=0 turns it off (A/B benchmarks); CPU tensors (the interpreter) never use it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # an older Triton: plain launches
    HAS_GDC = False
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """The first statement of a kernel launched through pdl_options."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def use_pdl(t: torch.Tensor) -> bool:
    return (HAS_GDC and t.is_cuda and os.environ.get("TAPSERVE_PDL", "1") != "0"
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def pdl_options(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel whose first statement is pdl_prologue(PDL)."""
    on = use_pdl(t)
    return {"PDL": on, "launch_pdl": on}
