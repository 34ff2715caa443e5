"""Triton temperature sampling in one pass over the logits (the Gumbel-max trick).

argmax_v(x_v / T + g_v), with g_v = -log(-log(u_v)) and u_v uniform, is distributed as
softmax(x / T): no softmax, no normalisation, no noise tensor in memory. One program per row
streams the row once (a running best per lane, one reduction at the end); the grid depends
only on the row count.

The uniform numbers come from a counter-based hash, C. Wellons' lowbias32 (two multiplies,
three xor-shifts; a bijection of 32-bit words) of the counter row * vocab + v, with the key
lowbias32(seed) xor-ed in after its first multiply: each seed permutes the counters its own
way (an added key would only shift one fixed stream), and a seed fixes the draw. It is about
a third of Philox's arithmetic per number. 23 bits of each hash make u = (k + 1/2) / 2**23,
in [2**-24, 1 - 2**-24]: exact in float32, never 0 or 1 (u = 1 would give a score of +inf,
a win whatever the logit).

For rows that sample with a temperature alone (no top-k, top-p or min-p); torch does the rest
(coordinator/sampler.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # vocab entries per loop iteration (fixed: no autotuning at start-up)
_LOG2_E = 1.4426950408889634


@triton.jit
def _keyed_hash(x, key):
    """x, key: uint32. lowbias32 with the key xor-ed in mid-way: for each key a bijection of
    x, and different keys give unrelated permutations."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= key
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit(do_not_specialize=["seed"])  # a seed of 1 would otherwise become a constexpr
def _gumbel_argmax_kernel(logits_ptr, stride, inv_temp, out_ptr, vocab, seed,
                          PER_ROW: tl.constexpr, BLOCK: tl.constexpr):
    """inv_temp: log2(e) / temperature, a pointer to one per row (PER_ROW) or one float for
    all. Base-2 logarithms: argmax(x / T - ln(-ln u)) = argmax(x log2(e) / T - log2(-log2 u)),
    and log2 is the GPU's native one."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    if PER_ROW:
        inv_temp = tl.load(inv_temp + row)
    key = _keyed_hash(seed.to(tl.uint32), 0)  # lowbias32(seed)
    first = (row * vocab).to(tl.uint32)
    k = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + k
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        bits = _keyed_hash(first + cols.to(tl.uint32), key)
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits: exact, in (0, 1)
        # the Gumbel score over ln 2: x / (T ln 2) - log2(-log2(u)) + a constant
        score = tl.where(mask, x * inv_temp - tl.log2(-tl.log2(u)), float("-inf"))
        better = score > best  # strict: per lane, the first column wins a tie
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
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
        raise ValueError("rows * vocab must stay below 2**31 (the counters are int32)")
    if isinstance(temperatures, list) and rows and temperatures.count(temperatures[0]) == rows:
        inv_temp: torch.Tensor | float = _LOG2_E / temperatures[0]
    else:
        inv_temp = torch.as_tensor(temperatures, dtype=torch.float32)
        inv_temp = (_LOG2_E / inv_temp.to(logits.device)).contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        block = min(_BLOCK, max(4, triton.next_power_of_2(vocab)))
        _gumbel_argmax_kernel[(rows,)](logits, logits.stride(0), inv_temp, out, vocab,
                                       seed & 0x7FFFFFFF, PER_ROW=not isinstance(inv_temp, float),
                                       BLOCK=block, num_warps=8 if block == _BLOCK else 4)
    return out
