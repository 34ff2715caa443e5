"""Triton paged decode attention: flash-decoding, the context split over programs and the
splits merged (docs/kernels.md).

One query token per sequence: q [B, H, D] attends to the first context_lens[b] tokens of
sequence b in k_cache / v_cache [num_blocks, block_size, Hkv, D] through block_tables; query
head h reads KV head h // (H // Hkv). A row with context_lens[b] == 0 (a padded CUDA-graph row)
yields zeros. No grid depends on the context lengths: with a preallocated workspace
(`make_decode_workspace`) the launches are CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tapserve.model.kernels.pdl import pdl_options, pdl_prologue
from tapserve.model.kernels.utils import LOG2E, dot_precision

DEFAULT_NUM_KV_SPLITS = 16


# stride_bt unspecialised: a table width of 1 or 16k would compile a variant mid-serving (~1 s)
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    seq_order_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    qk_scale,
    stride_qb,
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
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_fb,
    stride_fh,
    stride_fd,
    group_size,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    HAS_ORDER: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    kv_head = tl.program_id(0) // NUM_SPLITS
    split = tl.program_id(0) % NUM_SPLITS
    b = tl.program_id(1)
    if HAS_ORDER:
        b = tl.load(seq_order_ptr + b)

    ctx_len = tl.load(context_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, ctx_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < group_size
    mask_d = offs_d < head_dim
    heads = kv_head * group_size + offs_g  # query heads of this KV group

    q_ptrs = (
        q_ptr
        + b.to(tl.int64) * stride_qb
        + heads[:, None] * stride_qh
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    for start in range(split_start, split_end, BLOCK_N):
        tok = start + offs_n
        mask_n = tok < split_end
        page = tl.load(bt_row + tok // PAGE, mask=mask_n, other=0).to(tl.int64)
        in_page = (tok % PAGE).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
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

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [G, N], log2 units
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))

    gd_mask = mask_g[:, None] & mask_d[None, :]
    f_ptrs = (
        out_ptr
        + b.to(tl.int64) * stride_fb
        + heads[:, None] * stride_fh
        + offs_d[None, :] * stride_fd
    )
    if NUM_SPLITS == 1:  # the whole context in one program: no partial, no merge
        tl.store(f_ptrs, out.to(out_ptr.dtype.element_ty), mask=gd_mask)
        return
    o_ptrs = (
        part_out_ptr
        + b.to(tl.int64) * stride_ob
        + heads[:, None] * stride_oh
        + split * stride_os
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, out, mask=gd_mask)
    l_ptrs = part_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split * stride_ls
    tl.store(l_ptrs, lse, mask=mask_g)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_ob,
    stride_oh,
    stride_od,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < head_dim

    lse = tl.load(
        part_lse_ptr + b * stride_lb + h * stride_lh + offs_s * stride_ls,
        mask=mask_s,
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits weigh 0
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)

    part = tl.load(
        part_out_ptr
        + b * stride_pb
        + h * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :] * stride_pd,
        mask=mask_s[:, None] & mask_d[None, :] & (w[:, None] > 0.0),
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0) / denom
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


@triton.jit
def _longest_first_kernel(lens_ptr, order_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program: order[rank] = i, where row i's rank counts the rows with a longer context
    or an equal one and a lower index (O(n^2), one launch where a sort takes several)."""
    pdl_prologue(PDL)
    offs = tl.arange(0, BLOCK)
    for first_i in range(0, n, BLOCK):
        rows_i = first_i + offs
        lens_i = tl.load(lens_ptr + rows_i, mask=rows_i < n, other=0)
        rank = tl.zeros([BLOCK], dtype=tl.int32)
        for first_j in range(0, n, BLOCK):
            rows_j = first_j + offs
            lens_j = tl.load(lens_ptr + rows_j, mask=rows_j < n, other=-1)
            before = (lens_j[None, :] > lens_i[:, None]) | (
                (lens_j[None, :] == lens_i[:, None]) & (rows_j[None, :] < rows_i[:, None])
            )
            rank += tl.sum(before.to(tl.int32), 1)
        tl.store(order_ptr + rank, rows_i, mask=rows_i < n)


def longest_first(context_lens: torch.Tensor) -> torch.Tensor | None:
    """The rows by descending context, ties in row order: int32 [B] computed on the device (a
    CUDA graph recomputes it at each replay), or None for a single row."""
    n = context_lens.shape[0]
    if n < 2:
        return None
    order = torch.empty(n, dtype=torch.int32, device=context_lens.device)
    _longest_first_kernel[(1,)](
        context_lens, order, n, BLOCK=64, num_warps=4, **pdl_options(context_lens)
    )
    return order


def num_kv_splits_for(
    max_model_len: int, tokens_per_split: int = 256, max_splits: int = DEFAULT_NUM_KV_SPLITS
) -> int:
    """About one split per tokens_per_split tokens of max_model_len, within [1, max_splits]."""
    return max(1, min(max_splits, triton.cdiv(max_model_len, tokens_per_split)))


def make_decode_workspace(
    max_batch: int, num_heads: int, head_dim: int, num_kv_splits: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage-1 workspace (partial_out [max_batch, H, splits, D], partial_lse [max_batch, H,
    splits], float32) for any batch up to max_batch."""
    part_out = torch.empty(
        max_batch, num_heads, num_kv_splits, head_dim, dtype=torch.float32, device=device
    )
    part_lse = torch.empty(max_batch, num_heads, num_kv_splits, dtype=torch.float32, device=device)
    return part_out, part_lse


def decode_config(elem_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for stage 1, fixed per dtype (no register spills on
    sm_90 for head_dim <= 128)."""
    return (32, 8, 2) if elem_size >= 4 else (64, 4, 2)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_kv_splits: int = DEFAULT_NUM_KV_SPLITS,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: tuple[int, int, int] | None = None,
    seq_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of q [B, H, D] over paged K/V into out [B, H, D] (q's dtype; may be
    strided). context_lens [B] int32 counts this step's token; workspace: at least B rows and
    exactly num_kv_splits splits (else allocated per call). seq_order (`longest_first`) sets
    the launch order, never the result; config overrides (BLOCK_N, num_warps, num_stages)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert num_kv_splits >= 1
    assert batch <= 65535, "the batch is the grid's second dimension (CUDA: at most 65535)"
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if workspace is None:
        workspace = make_decode_workspace(batch, num_heads, head_dim, num_kv_splits, q.device)
    part_out, part_lse = workspace
    assert part_out.shape[0] >= batch and part_out.shape[1:] == (num_heads, num_kv_splits, head_dim)
    assert part_lse.shape[0] >= batch and part_lse.shape[1:] == (num_heads, num_kv_splits)

    block_n, warps, stages = config or decode_config(k_cache.element_size())
    block_d = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_kv_heads * num_kv_splits, batch)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        context_lens if seq_order is None else seq_order,
        part_out,
        part_lse,
        out,
        scale * LOG2E,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *part_out.stride(),
        *part_lse.stride(),
        *out.stride(),
        group,
        head_dim,
        NUM_SPLITS=num_kv_splits,
        HAS_ORDER=seq_order is not None,
        PAGE=k_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PREC=dot_precision(k_cache.dtype),
        num_warps=warps,
        num_stages=stages,
        **pdl_options(q),
    )
    if num_kv_splits == 1:
        return out
    _decode_merge_kernel[(batch, num_heads)](
        part_out,
        part_lse,
        out,
        *part_out.stride(),
        *part_lse.stride(),
        *out.stride(),
        head_dim,
        NUM_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_D=block_d,
        num_warps=1 if num_kv_splits * block_d <= 1024 else 2,
        **pdl_options(q),
    )
    return out
