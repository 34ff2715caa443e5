"""Triton paged extend (prefill) attention over cached prefix pages plus this step's tokens.

The contract of `model.attention.reference_attention`: q [T, H, D] packs the new tokens of B
sequences, sequence b owning rows query_start_loc[b]:query_start_loc[b+1] at the end of its
context_lens[b] cached tokens (this step's keys already stored), each attending causally;
every key is read through block_tables. Programs run over a work list (`extend_work`), which
may leave sequences out (docs/kernels.md).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tapserve.model.kernels.utils import LOG2E, dot_precision


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    start,
    bt_row,
    k_base,
    v_base,
    offs_n,
    offs_d,
    mask_d,
    pos,
    kv_end,
    qk_scale,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    PAGE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One BLOCK_N key tile of the online softmax; returns the updated (acc, m_i, l_i)."""
    tok = start + offs_n
    if MASKED:
        mask_n = tok < kv_end
        page = tl.load(bt_row + tok // PAGE, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
    else:
        page = tl.load(bt_row + tok // PAGE).to(tl.int64)
        kv_mask = mask_d[None, :]
    in_page = (tok % PAGE).to(tl.int64)
    k = tl.load(
        k_base
        + page[:, None] * stride_kb
        + in_page[:, None] * stride_ks
        + offs_d[None, :] * stride_kd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_base
        + page[:, None] * stride_vb
        + in_page[:, None] * stride_vs
        + offs_d[None, :] * stride_vd,
        mask=kv_mask,
        other=0.0,
    )
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, N]
    if MASKED:
        visible = (tok[None, :] <= pos[:, None]) & (tok < kv_end)[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


# stride_bt unspecialised: a table width of 1 or 16k would compile a variant mid-serving (~1 s)
@triton.jit(do_not_specialize=["stride_bt"])
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    work_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    block_tables_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    group_size,
    head_dim,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.load(work_ptr + 2 * tl.program_id(0))
    m_start = tl.load(work_ptr + 2 * tl.program_id(0) + 1)
    h = tl.program_id(1)

    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    ctx_len = tl.load(context_lens_ptr + b)
    prefix = ctx_len - q_len
    # keys < full_end are visible to every row of the block; keys < kv_end to some row
    full_end = (prefix + m_start) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(ctx_len, prefix + m_start + BLOCK_M)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < head_dim
    pos = prefix + offs_m
    rows = (q_start + offs_m).to(tl.int64)

    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    q = q.to(k_cache_ptr.dtype.element_ty)

    kv_head = (h // group_size).to(tl.int64)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            start,
            bt_row,
            k_base,
            v_base,
            offs_n,
            offs_d,
            mask_d,
            pos,
            kv_end,
            qk_scale,
            stride_kb,
            stride_ks,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vd,
            PAGE=PAGE,
            MASKED=False,
            DOT_PREC=DOT_PREC,
        )
    for start in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q,
            acc,
            m_i,
            l_i,
            start,
            bt_row,
            k_base,
            v_base,
            offs_n,
            offs_d,
            mask_d,
            pos,
            kv_end,
            qk_scale,
            stride_kb,
            stride_ks,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vd,
            PAGE=PAGE,
            MASKED=True,
            DOT_PREC=DOT_PREC,
        )

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_config(elem_size: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), fixed per dtype and head size."""
    if elem_size >= 4:  # exact fp32 dots run on FMA units; a test path, not a fast one
        return (32, 32, 8, 1)
    return (64, 64, 4, 2) if head_dim <= 128 else (64, 64, 8, 2)


def extend_work(query_lens: np.ndarray, block_m: int, seqs: np.ndarray | None = None) -> np.ndarray:
    """The kernel's work list: int32 [P, 2] of (sequence, first query row within it), one
    entry per BLOCK_M rows of each sequence in `seqs` (default: all), in order."""
    seqs = np.arange(len(query_lens)) if seqs is None else np.asarray(seqs)
    counts = -(-np.asarray(query_lens)[seqs] // block_m)
    first_entry = np.repeat(np.cumsum(counts) - counts, counts)
    rows = (np.arange(int(counts.sum())) - first_entry) * block_m
    return np.stack([np.repeat(seqs, counts), rows], axis=1).astype(np.int32)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Causal extend attention of q [T, H, D] over paged K/V into out [T, H, D] (q's dtype).
    work: `extend_work` with the BLOCK_M in use, on q's device (default: every sequence);
    rows outside it are not written. config overrides `extend_config`."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    batch = context_lens.shape[0]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert query_start_loc.shape[0] == batch + 1
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    block_m, block_n, warps, stages = config or extend_config(k_cache.element_size(), head_dim)
    if work is None:
        query_lens = np.diff(query_start_loc.cpu().numpy())
        work = torch.from_numpy(extend_work(query_lens, block_m)).to(q.device)
    assert (
        work.dtype == torch.int32
        and work.dim() == 2
        and work.shape[1] == 2
        and work.is_contiguous()
    ), "work: extend_work's [P, 2] int32 list"
    if work.shape[0] == 0:
        return out
    _extend_kernel[(work.shape[0], num_heads)](
        q,
        k_cache,
        v_cache,
        out,
        work,
        query_start_loc,
        context_lens,
        block_tables,
        scale * LOG2E,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        block_tables.stride(0),
        num_heads // num_kv_heads,
        head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PREC=dot_precision(k_cache.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out
