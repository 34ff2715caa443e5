"""Triton KV-cache store, the contract of `model.attention.store_kv`: k, v [T, num_kv_heads,
head_dim] go to flat slot slot_mapping[t] = block * block_size + offset of k_cache / v_cache,
cast to the cache dtype; rows with a negative slot (padded CUDA-graph rows) write nowhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tapserve.model.kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    num_kv_heads,
    head_dim,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    safe_slot = tl.where(valid, slot, 0)
    block = safe_slot // PAGE
    offset = safe_slot % PAGE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    live_heads = tl.where(valid, num_kv_heads, 0)  # a skipped row masks every head
    mask = (offs_h[:, None] < live_heads) & (offs_d[None, :] < head_dim)

    src_k = k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd
    src_v = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd
    dst_k = (
        k_cache_ptr
        + block * stride_kcb
        + offset * stride_kcs
        + offs_h[:, None] * stride_kch
        + offs_d[None, :] * stride_kcd
    )
    dst_v = (
        v_cache_ptr
        + block * stride_vcb
        + offset * stride_vcs
        + offs_h[:, None] * stride_vch
        + offs_d[None, :] * stride_vcd
    )

    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    tl.store(dst_k, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, num_kv_heads, head_dim] (may be strided views) into k_cache / v_cache
    at slot_mapping [T] (int32 or int64; negative slots skipped)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    assert k.shape == v.shape and k.dim() == 3, "k, v must be [T, num_kv_heads, head_dim]"
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4
    assert k_cache.shape[2:] == k.shape[1:], "cache [blocks, block_size, kv_heads, head_dim]"
    assert slot_mapping.shape[0] >= num_tokens
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        num_kv_heads,
        head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 2,
        **pdl_options(k),
    )
