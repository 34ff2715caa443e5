"""Triton kernels for paged attention and the KV-cache store.

Exports (loaded lazily, so `import model.kernels` works without Triton installed):
  paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=None,
                         num_kv_splits=16, workspace=None, config=None, seq_order=None)
  longest_first(context_lens) -> seq_order (rows by descending context) or None
  extend_attention(q, k_cache, v_cache, query_start_loc, context_lens, block_tables,
                   scale, out=None, work=None, config=None) -> out [T, H, D]
  store_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None
  make_decode_workspace(max_batch, num_heads, head_dim, num_kv_splits, device)
  num_kv_splits_for(max_model_len) -> int
  triton_available(device=None) -> bool
  rms_norm(x, weight, eps, out=None) -> normed                       (norm.py)
  fused_add_rms_norm(x, residual, weight, eps) -> (normed, x + residual)
  apply_rotary(q, k, cos, sin, positions) -> (q_rot, k_rot)          (rotary.py, new tensors)
  qk_norm_rotary(q, k, q_weight, k_weight, eps, cos, sin, positions) -> (q_rot, k_rot)
  rotary_store / qk_norm_rotary_store(..., KVStore(v, k_cache, v_cache, slot_mapping))
      -> q_rot, with k and v written into the KV cache                (rotary.py)
  silu_and_mul(x, out=None) -> silu(x[..., :I]) * x[..., I:]         (activation.py)
  gemv(x, weight, bias=None, config) -> x @ weight.T (+ bias), <= 8 rows  (gemv.py)

The kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1 set before triton is first imported).
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
    """Whether the Triton kernels can run on `device` (default: CUDA if present, else CPU).

    CUDA needs triton importable and a CUDA device; CPU needs triton importable and the
    interpreter switched on (TRITON_INTERPRET=1)."""
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
