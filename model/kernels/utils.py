"""Small helpers shared by the Triton kernels (no Triton import, so cheap to load)."""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634  # scores are kept in log2 units so the kernels can use exp2


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 ("ieee") for float32 caches so fp32 results match
    the torch reference (no TF32); the native tensor-core path ("tf32" is ignored for 16-bit
    operands) otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"
