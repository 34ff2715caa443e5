"""Triton temperature sampling in one pass over the logits (the Gumbel-max trick).

argmax_v(x_v / T + g_v), with g_v = -log(-log(u_v)) and u_v uniform, is distributed as
softmax(x / T): no softmax, no normalisation, no noise tensor in memory. The uniform numbers
come from Triton's counter-based Philox, so a seed fixes the draw. One program per row
streams the row once (a running best per lane, one reduction at the end); the grid depends
only on the row count.

Philox is most of the kernel's arithmetic, and each call yields four 32-bit numbers: a loop
step covers BLOCK columns as four quarters, column start + j * QUARTER + k taking the j-th
number of counter row * vocab + start + k (`tl.rand4x`). `tl.rand` would spend a whole call
on each column (measured on the H200 at 256 x 151,936: see docs/benchmarks.md).

For rows that sample with a temperature alone (no top-k, top-p or min-p); torch does the rest
(coordinator/sampler.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # vocab entries per loop iteration (fixed: no autotuning at start-up)


@triton.jit
def _gumbel_quarter(best, best_idx, base, cols, u, inv_temp, vocab):
    """Fold one quarter's Gumbel scores into the running best (strict: per lane, the first
    column wins a tie, as lanes visit their columns in increasing order)."""
    mask = cols < vocab
    x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
    score = tl.where(mask, x * inv_temp - tl.log(-tl.log(u)), float("-inf"))
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, best_idx)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, inv_temp, out_ptr, vocab, seed,
                          PER_ROW: tl.constexpr, QUARTER: tl.constexpr):
    """inv_temp: 1 / temperature, a pointer to one per row (PER_ROW) or one float for all."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    if PER_ROW:
        inv_temp = tl.load(inv_temp + row)
    k = tl.arange(0, QUARTER)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUARTER], tl.int32)
    for start in range(0, vocab, 4 * QUARTER):
        u0, u1, u2, u3 = tl.rand4x(seed, row * vocab + start + k)
        best, best_idx = _gumbel_quarter(best, best_idx, base, start + k, u0, inv_temp, vocab)
        best, best_idx = _gumbel_quarter(best, best_idx, base, start + QUARTER + k, u1, inv_temp, vocab)
        best, best_idx = _gumbel_quarter(best, best_idx, base, start + 2 * QUARTER + k, u2, inv_temp, vocab)
        best, best_idx = _gumbel_quarter(best, best_idx, base, start + 3 * QUARTER + k, u3, inv_temp, vocab)
    top = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_idx, vocab), 0).to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor | list[float],
                  seed: int) -> torch.Tensor:
    """One token per row of logits [rows, vocab] (any float dtype, last dim contiguous),
    drawn from softmax(logits / temperature); temperatures [rows] > 0. int64 [rows].
    A list of equal temperatures (the usual batch) travels as one float: no tensor, no copy."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("logits must be 2-D with a contiguous last dim")
    rows, vocab = logits.shape
    if len(temperatures) != rows:
        raise ValueError(f"{len(temperatures)} temperatures for {rows} rows")
    if rows * vocab >= 2**31:
        raise ValueError("rows * vocab must stay below 2**31 (Philox counters are int32)")
    if isinstance(temperatures, list) and rows and temperatures.count(temperatures[0]) == rows:
        inv_temp: torch.Tensor | float = 1.0 / temperatures[0]
    else:
        inv_temp = torch.as_tensor(temperatures, dtype=torch.float32)
        inv_temp = (1.0 / inv_temp.to(logits.device)).contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block = min(_BLOCK, max(4, triton.next_power_of_2(vocab)))
        _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), inv_temp, out, vocab,
                                       seed & 0x7FFFFFFF, PER_ROW=not isinstance(inv_temp, float),
                                       QUARTER=block // 4, num_warps=8 if block == _BLOCK else 4)
    return out
