"""Programmatic dependent launch (PDL) for the decode path's kernels.

A batch-1 decode step is ~400 short kernels in a CUDA graph, and the GPU idles for a moment
between any two of them. Launched with PDL (Hopper and newer), a kernel is scheduled while
its predecessor still runs: every kernel here waits for its predecessor to finish (and its
writes to land) before it reads anything but constants (the GEMV reads its first weight
tile before the wait), and lets its own successor launch at once. A kernel finishes only
after its wait, so the chain stays transitive: no kernel reads what an earlier one has not
finished writing. Kernels of other libraries in between (cuBLAS, torch, NCCL) launch as
usual.

Two rules keep this safe, and every kernel launched through pdl_options must follow them:
  * pdl_prologue (or, in the GEMV, gdc_wait) comes before any read of another kernel's
    output and before any write; no program returns before it;
  * what a kernel reads before its wait is constant while serving (the weights: nothing on
    the GPU writes them after loading).

TAPSERVE_PDL=0 turns it off (A/B benchmarks; read once, at import); CPU tensors (the
interpreter) and GPUs before Hopper never use it.
"""

from __future__ import annotations

import functools
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


PDL_ENABLED = HAS_GDC and os.environ.get("TAPSERVE_PDL", "1") != "0"  # a constant


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(t: torch.Tensor) -> bool:
    return PDL_ENABLED and t.is_cuda and _device_has_pdl(t.device.index or 0)


def pdl_options(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel whose first statement is pdl_prologue(PDL)."""
    on = use_pdl(t)
    return {"PDL": on, "launch_pdl": on}
