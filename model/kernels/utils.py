"""Small helpers shared by the Triton kernels (no Triton import, so cheap to load)."""

from __future__ import annotations

import torch

LOG2E = 1.4426950408889634  # scores are kept in log2 units so the kernels can use exp2


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact "ieee" for float32 (no TF32: results match torch's), the
    native tensor-core path otherwise ("tf32" is ignored for 16-bit operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"
