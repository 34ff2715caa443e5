"""Triton RMSNorm, plain or fused with the residual add, over the last dim of any leading shape,
with the roundings of `model.layers.RMSNorm.forward`: the sum of squares in fp32, the normed
value rounded to the input dtype, times the weight in fp32, rounded once; fused, the sum
x + residual is rounded to x's dtype first. Up to two leading dims may be strided (q / k views
of a fused QKV projection), with no copy. Outputs are new contiguous tensors (or `out`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tapserve.model.kernels.pdl import pdl_options, pdl_prologue


@triton.jit(do_not_specialize=["n_rows"])  # one compile for every batch size
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    inner,
    n_cols,
    sx0,
    sx1,
    sr0,
    sr1,
    so0,
    so1,
    sro0,
    sro1,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < n_cols)
    outer = rows // inner
    inn = rows % inner

    x = tl.load(x_ptr + (outer * sx0 + inn * sx1)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(
            r_ptr + (outer * sr0 + inn * sr1)[:, None] + cols[None, :], mask=mask, other=0.0
        )
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + (outer * sro0 + inn * sro1)[:, None] + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = (normed * w[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (outer * so0 + inn * so1)[:, None] + cols[None, :], y, mask=mask)


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """(tensor, n_rows, inner, stride_outer, stride_inner), row r at (r // inner) * stride_outer
    + (r % inner) * stride_inner; a copy only where no such layout exists."""
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.stride(-1) != 1:
        t = t.contiguous()
    lead = t.shape[:-1]
    if len(lead) > 2:
        try:
            t = t.view(-1, t.shape[-2], t.shape[-1])
        except RuntimeError:
            t = t.reshape(-1, t.shape[-2], t.shape[-1])
        lead = t.shape[:-1]
    if len(lead) == 1:
        return t, lead[0], 1, t.stride(0), 0
    inner = lead[1]
    return t, lead[0] * inner, inner, t.stride(0), t.stride(1)


def _launch_cfg(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps): several short rows (per-head norm) a program, a few KB each."""
    block_n = triton.next_power_of_2(n_cols)
    rows = max(1, min(16, 2048 // block_n))
    tile = block_n * rows
    num_warps = 1 if tile <= 256 else 2 if tile <= 1024 else 4 if tile <= 4096 else 8
    return block_n, rows, num_warps


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} does not match last dim {x.shape[-1]}"
        )
    if x.device != weight.device:
        raise ValueError("x and weight must be on the same device")


def _run(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    res_out: torch.Tensor | None,
) -> None:
    n_cols = x.shape[-1]
    xs, n_rows, inner, sx0, sx1 = _as_rows(x)
    os_, _, _, so0, so1 = _as_rows(out)
    if residual is not None:
        rs, _, _, sr0, sr1 = _as_rows(residual)
        ros, _, _, sro0, sro1 = _as_rows(res_out)
    else:
        rs, sr0, sr1, ros, sro0, sro1 = xs, 0, 0, xs, 0, 0
    if n_rows == 0:
        return
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    block_n, rows, num_warps = _launch_cfg(n_cols)
    grid = (triton.cdiv(n_rows, rows),)
    _rms_norm_kernel[grid](
        xs,
        rs,
        w,
        os_,
        ros,
        n_rows,
        inner,
        n_cols,
        sx0,
        sx1,
        sr0,
        sr1,
        so0,
        so1,
        sro0,
        sro1,
        float(eps),
        HAS_RESIDUAL=residual is not None,
        ROWS=rows,
        BLOCK_N=block_n,
        num_warps=num_warps,
        **pdl_options(xs),
    )
    if out.data_ptr() != os_.data_ptr():  # `out` needed a contiguous stand-in
        out.copy_(os_)
    if res_out is not None and res_out.data_ptr() != ros.data_ptr():
        res_out.copy_(ros)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x [..., N] over the last dim; returns `out` (default: a new contiguous tensor
    of x's shape, dtype = promote(x.dtype, weight.dtype) as in torch)."""
    _check(x, weight)
    if out is None:
        out = torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device
        )
    _run(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual) as new tensors, the sum rounded to x.dtype first."""
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} does not match "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _run(x, residual, weight, eps, out, new_residual)
    return out, new_residual
