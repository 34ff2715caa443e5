"""Triton temperature sampling in one pass over the logits (the Gumbel-max trick).

argmax_v(x_v / T + g_v), with g_v = -log(-log(u_v)) and u_v uniform, is distributed as
softmax(x / T): no softmax, no normalisation, no noise tensor in memory.

Each row is split into `splits` chunks of whole loop blocks, one program each, since one
program streaming a whole 151,936-wide row is bound by its own memory latency: on an H200, one
row took 68 us of GPU time unsplit and 7 us split 75 ways, 64 rows 70 and 38 us. (256 rows,
~122 us split and ~135 unsplit, are bound by arithmetic, most of it the two accurate log2s,
not by the 36 us of their bytes.) Pass 1, grid rows x splits: each program streams its chunk
once, a running best per lane, and writes the chunk's best score and the first column holding
it to a small scratch. Pass 2, one program a row: the highest of those scores, ties to the
lowest column. Either way the winner is the row's first column with the highest score, so the
split and the block change the speed, never the token: each (row, column) scores as before,
only the reduction is split. NaN scores never win; a row with no score above -inf draws
column 0. `splits` follows from the row and vocab counts alone (about _PROGRAMS programs in
all), and it, the chunk width and the seed reach the kernels as runtime ints: a new batch
size compiles no new variant.

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

_BLOCK = 2048  # vocab entries per loop iteration, 8 warps (fixed: no autotuning at start-up)
_PROGRAMS = 4096  # pass-1 programs to aim for (about 30 per SM of an H200): rows x splits
_MAX_SPLITS = 128  # chunks per row at most (pass 2's lanes): one block each for 151,936
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


# runtime ints, never constexpr: a seed, chunk or split count of 1 (or one divisible by 16)
# would otherwise compile a variant of its own, and the batch size sets chunk and splits
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
    """Pass 1, program (row, split): over columns [split * chunk, (split + 1) * chunk) of the
    row, the highest score and the first column holding it, to part_ptr [rows, splits, 2]
    int32 (the score's float32 bits, the column; -inf and 0 if no score beats -inf).
    inv_temp: log2(e) / temperature, a pointer to one per row (PER_ROW) or one float for all.
    Base-2 logarithms: argmax(x / T - ln(-ln u)) = argmax(x log2(e) / T - log2(-log2 u)).
    (tl.log2 is libdevice's accurate log2f: the faster lg2.approx would move near ties.)"""
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
        # the Gumbel score over ln 2: x / (T ln 2) - log2(-log2(u)) + a constant
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
    column (the chunks lie in column order, each with its first best column). A row with no
    score above -inf gets its chunks' 0."""
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
    """(splits, chunk): chunks of whole blocks, about _PROGRAMS programs over all rows (or
    about `splits` chunks a row if given), at most _MAX_SPLITS and one block each at least."""
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
    """One token per row of logits [rows, vocab] (any float dtype, last dim contiguous),
    drawn from softmax(logits / temperature); temperatures [rows] > 0. int64 [rows].
    A list of equal temperatures (the usual batch) travels as one float: no tensor, no copy.
    _splits (chunks a row, at most) and _block (a power of two) are for tests and benchmarks:
    they change the speed, never the token."""
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
    """Both passes; the scratch [rows, splits, 2] is allocated per call (a few KB)."""
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
