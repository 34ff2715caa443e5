"""Triton kernels for the CUDA hot path (docs/kernels.md), exported lazily: importing this
package needs no Triton. They run on CUDA tensors, or on CPU tensors under the Triton
interpreter (TRITON_INTERPRET=1 set before triton is first imported).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch

GEMV_MAX_ROWS = 8  # the most rows the GEMV (gemv.py) takes: here, for callers without Triton

_LAZY = {
    "paged_decode_attention": "decode",
    "make_decode_workspace": "decode",
    "num_kv_splits_for": "decode",
    "longest_first": "decode",
    "DEFAULT_NUM_KV_SPLITS": "decode",
    "extend_attention": "extend",
    "store_kv_cache": "store",
    "rms_norm": "norm",
    "fused_add_rms_norm": "norm",
    "apply_rotary": "rotary",
    "qk_norm_rotary": "rotary",
    "rotary_store": "rotary",
    "qk_norm_rotary_store": "rotary",
    "KVStore": "rotary",
    "silu_and_mul": "activation",
    "gemv": "gemv",
}

__all__ = [*_LAZY, "triton_available", "GEMV_MAX_ROWS"]


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernels can run on `device` (default: CUDA if present, else CPU):
    triton importable, and a CUDA device or (CPU) TRITON_INTERPRET=1."""
    try:
        if importlib.util.find_spec("triton") is None:
            return False
    except (ImportError, ValueError):  # a broken or blocked install
        return False
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available()
    return kind == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def __getattr__(name: str) -> Any:
    """PEP 562 lazy export: import the kernel module (and triton) on first use."""
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
