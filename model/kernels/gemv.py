"""Triton GEMV for decode's few-row linears: y = x W^T (+ b), x [M, K] with M <= MAX_ROWS, W
[N, K] (nn.Linear's layout). Launch configs are fixed per weight shape (gemv_configs.json); the
grid depends only on N, so it is CUDA-graph capturable. Design and figures: docs/kernels.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from tapserve.model.kernels import GEMV_MAX_ROWS as MAX_ROWS  # the largest M; more stay on cuBLAS
from tapserve.model.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    reduce_each: bool = False  # sum each tile over K at once: a [M, BLOCK_N] accumulator


DEFAULT_CONFIG = GemvConfig(block_n=4, block_k=512, num_warps=2, num_stages=3)
WIDE_ROWS = 12288  # weights of other shapes with at least this many rows stay on cuBLAS
MEASURED_CONFIGS_PATH = Path(__file__).with_name("gemv_configs.json")
_TABLE_NOTES = {"tbs", "cublas_tbs", "linear"}  # what an entry records besides its config


def parse_shape(shape: str) -> tuple[int, int]:
    """A table key "NxK" as (N, K)."""
    n, k = shape.split("x")
    return int(n), int(k)


def load_measured_configs(
    path: Path = MEASURED_CONFIGS_PATH,
) -> Mapping[tuple[int, int], GemvConfig | None]:
    """The config measured fastest per weight shape (N, K) at one row (`bench/gemv.py --sweep
    --write-configs`), None where cuBLAS won; an unknown key in an entry raises."""
    table: dict[tuple[int, int], GemvConfig | None] = {}
    for shape, entry in json.loads(path.read_text())["configs"].items():
        fields = {key: value for key, value in entry.items() if key not in _TABLE_NOTES}
        table[parse_shape(shape)] = None if fields == {"cublas": True} else GemvConfig(**fields)
    return MappingProxyType(table)


MEASURED_CONFIGS = load_measured_configs()  # read once at import; read-only


@triton.jit
def _load_tile(ptrs, k, K, row_ok, cols, EVEN_K: tl.constexpr, STREAM: tl.constexpr):
    """Columns [k, k + BLOCK_K) of the rows at ptrs (masked rows and columns read as 0)."""
    mask = row_ok[:, None] if EVEN_K else row_ok[:, None] & ((cols + k) < K)[None, :]
    if STREAM:  # the weight: read once per step, not worth keeping in L2
        return tl.load(ptrs + k, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(ptrs + k, mask=mask, other=0.0)


@triton.jit
def _products(w, x, REDUCE_EACH: tl.constexpr):
    """[M, BLOCK_N, BLOCK_K] fp32 products of one tile, or (REDUCE_EACH) their sums over K."""
    products = w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    return tl.sum(products, axis=2) if REDUCE_EACH else products


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    REDUCE_EACH: tl.constexpr,
    PDL: tl.constexpr,
):
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    n_ok = rows_n < N
    m_ok = rows_m < M
    w_ptrs = w_ptr + rows_n.to(tl.int64)[:, None] * K + cols[None, :]
    x_ptrs = x_ptr + rows_m[:, None] * stride_x + cols[None, :]
    # under PDL the first (constant) weight tile is read before the wait; x only after it
    if PDL:
        gdc_launch_dependents()
    w = _load_tile(w_ptrs, 0, K, n_ok, cols, EVEN_K, True)
    if PDL:
        gdc_wait()
    x = _load_tile(x_ptrs, 0, K, m_ok, cols, EVEN_K, False)
    acc = _products(w, x, REDUCE_EACH)
    for k in range(BLOCK_K, K, BLOCK_K):
        w = _load_tile(w_ptrs, k, K, n_ok, cols, EVEN_K, True)
        x = _load_tile(x_ptrs, k, K, m_ok, cols, EVEN_K, False)
        acc += _products(w, x, REDUCE_EACH)
    y = acc if REDUCE_EACH else tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rows_m[:, None] * stride_y + rows_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig = DEFAULT_CONFIG,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight [N, K].T (+ bias): [..., N] in x's dtype,
    accumulated in fp32, into out when given; a ValueError for shapes it does not take."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or weight.stride(1) != 1 or weight.stride(0) != k:
        raise ValueError(f"weight {tuple(weight.shape)} is not a contiguous [N, {k}] matrix")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} is not a contiguous [{n}] vector")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif (
        out.shape != (*x.shape[:-1], n)
        or out.dtype != x.dtype
        or not out.is_contiguous()
        or out.device != x.device
    ):
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} is not a contiguous "
            f"{(*x.shape[:-1], n)} {x.dtype} tensor"
        )
    else:
        y = out.view(m, n)
    if m and n:
        block_k = min(config.block_k, triton.next_power_of_2(k))
        _gemv_kernel[(triton.cdiv(n, config.block_n),)](
            x2,
            weight,
            bias if bias is not None else weight,
            y,
            m,
            n,
            k,
            x2.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=triton.next_power_of_2(m),
            BLOCK_N=config.block_n,
            BLOCK_K=block_k,
            EVEN_K=k % block_k == 0,
            REDUCE_EACH=config.reduce_each,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **pdl_options(x),
        )
    return y.view(*x.shape[:-1], n)


def gemv_config(n: int, k: int, rows: int) -> GemvConfig | None:
    """The launch config for a weight [n, k] at `rows` rows, or None for cuBLAS: the measured
    one at one row, else DEFAULT_CONFIG below WIDE_ROWS rows."""
    if rows == 1 and (n, k) in MEASURED_CONFIGS:
        return MEASURED_CONFIGS[(n, k)]
    return None if n >= WIDE_ROWS else DEFAULT_CONFIG
