"""Programmatic dependent launch (PDL) for the decode path's kernels (docs/kernels.md).

A kernel launched through pdl_options calls pdl_prologue (or, in the GEMV, gdc_wait) before it
reads another kernel's output or writes anything, and reads only constants before it.
TAPSERVE_PDL=0 (read at import) turns it off; CPU tensors and GPUs before Hopper never use it.
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
