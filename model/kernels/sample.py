"""Triton temperature sampling in one pass over the logits (the Gumbel-max trick; design in
docs/kernels.md): a draw from softmax(logits / T), fixed by the seed, for rows that sample with
a temperature alone (torch does top-k, top-p and min-p: coordinator/sampler.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048  # vocab entries per loop iteration, 8 warps (fixed: no autotuning at start-up)
_PROGRAMS = 4096  # pass-1 programs to aim for (about 30 per SM of an H200): rows x splits
_MAX_SPLITS = 128  # chunks per row at most (pass 2's lanes): one block each for 151,936
_LOG2_E = 1.4426950408889634


@triton.jit
def _keyed_hash(x, key):
    """lowbias32 of x (uint32) with the key xor-ed in mid-way: a bijection of x per key."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= key
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


# runtime ints: a seed, chunk or split count of 1 (or divisible by 16) would compile a variant
@triton.jit(do_not_specialize=["seed", "chunk", "splits"])
def _chunk_best_kernel(
    logits_ptr,
    stride,
    inv_temp,
    part_ptr,
    vocab,
    chunk,
    splits,
    seed,
    PER_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pass 1, program (row, split): the highest score over the split's chunk of columns and
    the first column holding it, to part_ptr [rows, splits, 2] int32 (float32 bits, column;
    -inf and 0 if none beats -inf). inv_temp: log2(e) / T, per row (PER_ROW) or one float."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    base = logits_ptr + row.to(tl.int64) * stride
    if PER_ROW:
        inv_temp = tl.load(inv_temp + row)
    key = _keyed_hash(seed.to(tl.uint32), 0)  # lowbias32(seed)
    first = (row * vocab).to(tl.uint32)
    k = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = tl.zeros([BLOCK], tl.int32)
    lo = split * chunk
    for start in range(lo, lo + chunk, BLOCK):
        cols = start + k
        mask = cols < vocab
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        bits = _keyed_hash(first + cols.to(tl.uint32), key)
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits: exact, in (0, 1)
        score = tl.where(mask, x * inv_temp - tl.log2(-tl.log2(u)), float("-inf"))
        better = score > best  # strict: per lane, the first column wins a tie; NaN never
        best = tl.where(better, score, best)
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best, 0)
    at = part_ptr + (row * splits + split) * 2
    tl.store(at, top.to(tl.int32, bitcast=True))
    tl.store(at + 1, tl.min(tl.where(best == top, best_col, vocab), 0))


@triton.jit(do_not_specialize=["splits"])
def _pick_kernel(part_ptr, out_ptr, vocab, splits, MAX_SPLITS: tl.constexpr):
    """Pass 2, one program a row: the highest of the row's chunk scores, ties to the lowest
    column; a row with no score above -inf gets column 0."""
    row = tl.program_id(0)
    s = tl.arange(0, MAX_SPLITS)
    mask = s < splits
    at = part_ptr + (row * splits + s) * 2
    best = tl.load(at, mask=mask, other=0).to(tl.float32, bitcast=True)
    best = tl.where(mask, best, float("-inf"))
    col = tl.load(at + 1, mask=mask, other=vocab)
    top = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, col, vocab), 0).to(tl.int64))


def _split(rows: int, vocab: int, block: int, splits: int | None) -> tuple[int, int]:
    """(splits, chunk): whole blocks a chunk, about _PROGRAMS programs in all (or `splits` a
    row), within _MAX_SPLITS."""
    blocks = max(1, triton.cdiv(vocab, block))
    want = splits if splits is not None else triton.cdiv(_PROGRAMS, rows)
    per_chunk = triton.cdiv(blocks, max(1, min(want, blocks, _MAX_SPLITS)))
    return triton.cdiv(blocks, per_chunk), per_chunk * block


def gumbel_sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor | list[float],
    seed: int,
    *,
    _splits: int | None = None,
    _block: int = _BLOCK,
) -> torch.Tensor:
    """One token per row of logits [rows, vocab] (float, last dim contiguous), drawn from
    softmax(logits / temperature), temperatures [rows] > 0: int64 [rows]; a ValueError for bad
    shapes. _splits and _block (tests, benchmarks) change the speed, never the token."""
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
        if logits.is_cuda and inv_temp.device.type == "cpu":  # pinned: no wait for the GPU
            inv_temp = inv_temp.pin_memory().to(logits.device, non_blocking=True)
        inv_temp = (_LOG2_E / inv_temp).contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _launch(logits, inv_temp, out, seed & 0x7FFFFFFF, _splits, _block)
    return out


def _launch(
    logits: torch.Tensor,
    inv_temp: torch.Tensor | float,
    out: torch.Tensor,
    seed: int,
    splits: int | None,
    block: int,
) -> None:
    """Both passes, with a scratch [rows, splits, 2] allocated per call (a few KB)."""
    rows, vocab = logits.shape
    block = min(block, max(4, triton.next_power_of_2(vocab)))
    splits, chunk = _split(rows, vocab, block, splits)
    part = torch.empty((rows, splits, 2), dtype=torch.int32, device=logits.device)
    _chunk_best_kernel[(rows, splits)](
        logits,
        logits.stride(0),
        inv_temp,
        part,
        vocab,
        chunk,
        splits,
        seed,
        PER_ROW=not isinstance(inv_temp, float),
        BLOCK=block,
        num_warps=8 if block >= _BLOCK else 4,
    )
    _pick_kernel[(rows,)](part, out, vocab, splits, MAX_SPLITS=_MAX_SPLITS, num_warps=1)
