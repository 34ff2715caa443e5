"""Triton SiLU-and-mul: x [..., 2*I] -> silu(x[..., :I]) * x[..., I:] as [..., I], rounded as
`model.layers.SiluAndMul.forward` rounds (silu in fp32, rounded to x's dtype, times up in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tapserve.model.kernels.pdl import pdl_options, pdl_prologue

_BLOCK = 1024  # columns per program (a fixed launch config: no autotuning at start-up)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_inter, sx, so, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_inter
    gate = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * sx + n_inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(
        out_ptr + row * so + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask
    )


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for x [..., 2*I] (gate first, as the merged gate_up projection);
    returns `out` (default a new contiguous tensor [..., I] of x's dtype)."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} is odd")
    n_inter = x.shape[-1] // 2
    if out is None:
        out = torch.empty((*x.shape[:-1], n_inter), dtype=x.dtype, device=x.device)
    elif out.shape != (*x.shape[:-1], n_inter):
        raise ValueError(f"out shape {tuple(out.shape)} does not match {(*x.shape[:-1], n_inter)}")
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = (
        out.view(-1, n_inter)
        if out.is_contiguous()
        else torch.empty((x2.shape[0], n_inter), dtype=out.dtype, device=out.device)
    )
    rows = x2.shape[0]
    if rows and n_inter:
        block = min(_BLOCK, triton.next_power_of_2(n_inter))
        grid = (rows, triton.cdiv(n_inter, block))
        _silu_and_mul_kernel[grid](
            x2,
            o2,
            n_inter,
            x2.stride(0),
            o2.stride(0),
            BLOCK=block,
            num_warps=4 if block >= 1024 else 2 if block >= 256 else 1,
            **pdl_options(x2),
        )
    if not out.is_contiguous():  # o2 was a contiguous stand-in
        out.copy_(o2.view(out.shape))
    return out
