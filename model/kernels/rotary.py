"""Triton rotary embedding (rotate-half, as `model.rotary._apply`: fp32 cos/sin caches, the
result rounded to x's dtype), optionally after Qwen3's per-head q/k RMSNorm (rounded as
`model.layers.RMSNorm.forward`), optionally writing the rotated k and v into the paged KV cache
(`KVStore`, the contract of `model.attention.store_kv`) in the same launch. q and k may be
strided views with a contiguous last dim; results are new contiguous tensors.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tapserve.model.kernels.pdl import pdl_options, pdl_prologue


@triton.jit
def _rotate_heads(
    src,
    dst,
    s_h,
    d_h,
    n_heads,
    cos1,
    sin1,
    cos2,
    sin2,
    w1,
    w2,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NORM: tl.constexpr,
):
    """Rotate (and optionally RMS-normalize) one token's [n_heads, HEAD_DIM] tile, src to dst."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = offs_h[:, None] < n_heads
    p1 = src + offs_h[:, None] * s_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    if NORM:
        var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM
        rstd = 1.0 / tl.sqrt(var + eps)
        f1 = (f1 * rstd[:, None]).to(dtype).to(tl.float32)
        f2 = (f2 * rstd[:, None]).to(dtype).to(tl.float32)
        f1 = (f1 * w1[None, :]).to(dtype).to(tl.float32)
        f2 = (f2 * w2[None, :]).to(dtype).to(tl.float32)
    # separate products, then the sum, as torch evaluates x*cos + rot*sin
    a1 = f1 * cos1[None, :]
    b1 = -f2 * sin1[None, :]
    a2 = f2 * cos2[None, :]
    b2 = f1 * sin2[None, :]
    o1 = (a1 + b1).to(dst.dtype.element_ty)
    o2 = (a2 + b2).to(dst.dtype.element_ty)
    q1 = dst + offs_h[:, None] * d_h + offs_d[None, :]
    tl.store(q1, o1, mask=mask)
    tl.store(q1 + HALF, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    qw_ptr,
    kw_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sqo_t,
    sqo_h,
    sko_t,
    sko_h,
    s_cos,
    s_sin,
    sv_t,
    sv_h,
    skc_b,
    skc_s,
    skc_h,
    svc_b,
    svc_s,
    svc_h,
    n_q_heads,
    n_k_heads,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos1 = tl.load(cos_ptr + pos * s_cos + offs_d)
    cos2 = tl.load(cos_ptr + pos * s_cos + HALF + offs_d)
    sin1 = tl.load(sin_ptr + pos * s_sin + offs_d)
    sin2 = tl.load(sin_ptr + pos * s_sin + HALF + offs_d)
    if NORM:
        qw1 = tl.load(qw_ptr + offs_d).to(tl.float32)
        qw2 = tl.load(qw_ptr + HALF + offs_d).to(tl.float32)
        kw1 = tl.load(kw_ptr + offs_d).to(tl.float32)
        kw2 = tl.load(kw_ptr + HALF + offs_d).to(tl.float32)
    else:
        qw1 = cos1
        qw2 = cos1
        kw1 = cos1
        kw2 = cos1
    _rotate_heads(
        q_ptr + t * sq_t,
        qo_ptr + t * sqo_t,
        sq_h,
        sqo_h,
        n_q_heads,
        cos1,
        sin1,
        cos2,
        sin2,
        qw1,
        qw2,
        eps,
        HEAD_DIM,
        HALF,
        BLOCK_HQ,
        NORM,
    )
    if STORE:  # k and v go to the token's cache slot; a slot < 0 masks every head
        slot = tl.load(slot_ptr + t).to(tl.int64)
        live = tl.where(slot >= 0, n_k_heads, 0)
        slot = tl.maximum(slot, 0)
        k_dst = kc_ptr + (slot // PAGE) * skc_b + (slot % PAGE) * skc_s
        _rotate_heads(
            k_ptr + t * sk_t,
            k_dst,
            sk_h,
            skc_h,
            live,
            cos1,
            sin1,
            cos2,
            sin2,
            kw1,
            kw2,
            eps,
            HEAD_DIM,
            HALF,
            BLOCK_HK,
            NORM,
        )
        offs_h = tl.arange(0, BLOCK_HK)
        offs_v = tl.arange(0, HEAD_DIM)
        v_mask = offs_h[:, None] < live
        v = tl.load(v_ptr + t * sv_t + offs_h[:, None] * sv_h + offs_v[None, :], mask=v_mask)
        v_dst = vc_ptr + (slot // PAGE) * svc_b + (slot % PAGE) * svc_s
        tl.store(
            v_dst + offs_h[:, None] * svc_h + offs_v[None, :],
            v.to(vc_ptr.dtype.element_ty),
            mask=v_mask,
        )
    else:
        _rotate_heads(
            k_ptr + t * sk_t,
            ko_ptr + t * sko_t,
            sk_h,
            sko_h,
            n_k_heads,
            cos1,
            sin1,
            cos2,
            sin2,
            kw1,
            kw2,
            eps,
            HEAD_DIM,
            HALF,
            BLOCK_HK,
            NORM,
        )


class KVStore(NamedTuple):
    """Where the fused kernel writes k and v: `model.attention.store_kv`'s arguments."""

    v: torch.Tensor  # [T, Hkv, D], last dim contiguous (may be a view of a fused QKV output)
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], last dim contiguous
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [>=T] int32/int64 flat slots, -1: nowhere


def _prep(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, heads, head_dim], got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _prep(q, "q"), _prep(k, "k")
    t, n_q, d = q.shape
    n_k = k.shape[1]
    if k.shape[0] != t or k.shape[2] != d or positions.shape != (t,):
        raise ValueError(
            f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
            f"{tuple(positions.shape)} do not agree"
        )
    if d % 2 or d & (d - 1):
        raise ValueError(f"head_dim {d} must be an even power of two")
    if cos.shape[-1] != d or sin.shape[-1] != d:
        raise ValueError(f"cos/sin last dim {cos.shape[-1]} != head_dim {d}")
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape if store is None else (0,), dtype=k.dtype, device=k.device)
    if store is not None:
        store = store._replace(v=_prep(store.v, "v"))
        _check_store(k, store)
    if t == 0:
        return q_out, k_out
    norm = q_weight is not None
    if norm:
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
        if q_weight.shape != (d,) or k_weight.shape != (d,):
            raise ValueError("q/k norm weights must be [head_dim]")
    block_hq, block_hk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    tile = (block_hq + block_hk) * d
    num_warps = 1 if tile <= 1024 else 2 if tile <= 4096 else 4
    v, k_cache, v_cache, slots = store if store is not None else (k, k_out, k_out, positions)
    _rotary_kernel[(t,)](
        q,
        k,
        q_out,
        k_out,
        cos,
        sin,
        positions,
        q_weight if norm else cos,
        k_weight if norm else cos,
        v,
        k_cache,
        v_cache,
        slots,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        *(k_out.stride() if store is None else (0, 0))[:2],
        cos.stride(0),
        sin.stride(0),
        *_store_strides(store),
        n_q,
        n_k,
        float(eps),
        HEAD_DIM=d,
        HALF=d // 2,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        NORM=norm,
        STORE=store is not None,
        PAGE=k_cache.shape[1] if store is not None else 1,
        num_warps=num_warps,
        **pdl_options(q),
    )
    return q_out, k_out


def _check_store(k: torch.Tensor, store: KVStore) -> None:
    t, n_k, d = k.shape
    if store.v.shape != k.shape:
        raise ValueError(f"v {tuple(store.v.shape)} does not match k {tuple(k.shape)}")
    cache_shape = store.k_cache.shape
    if (
        store.v_cache.shape != cache_shape
        or len(cache_shape) != 4
        or tuple(cache_shape[2:]) != (n_k, d)
    ):
        raise ValueError(
            f"caches {tuple(cache_shape)}, {tuple(store.v_cache.shape)} are not "
            f"[blocks, block_size, {n_k}, {d}]"
        )
    if store.k_cache.stride(-1) != 1 or store.v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dim must be contiguous")
    if store.k_cache.dtype != k.dtype or store.v_cache.dtype != store.v.dtype:
        # rotary then store rounds k to its dtype first: one rounding here would differ
        raise ValueError(
            f"cache dtypes {store.k_cache.dtype}, {store.v_cache.dtype} differ "
            f"from k, v ({k.dtype}, {store.v.dtype})"
        )
    if store.slot_mapping.shape[0] < t:
        raise ValueError(f"{store.slot_mapping.shape[0]} slots for {t} tokens")


def _store_strides(store: KVStore | None) -> tuple[int, ...]:
    """(sv_t, sv_h, skc_b, skc_s, skc_h, svc_b, svc_s, svc_h); zeros without a store."""
    if store is None:
        return (0,) * 8
    return (*store.v.stride()[:2], *store.k_cache.stride()[:3], *store.v_cache.stride()[:3])


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [T, H, D] and k [T, Hkv, D] at positions [T] (int32/int64) from the fp32
    caches cos/sin [max_pos, D]. Returns new contiguous (q_rot, k_rot) in the input dtypes."""
    return _launch(q, k, cos, sin, positions, None, None, 0.0)


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3: per-head RMSNorm of q and k (weights [D], one eps) followed by RoPE, in one
    kernel; equal to rotary(rms_norm(q), rms_norm(k)). Returns new contiguous tensors."""
    return _launch(q, k, cos, sin, positions, q_weight, k_weight, eps)


def rotary_store(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    store: KVStore,
) -> torch.Tensor:
    """apply_rotary, with the rotated k and store.v written into the paged KV cache (as
    `store_kv`) instead of returned: returns q_rot only."""
    return _launch(q, k, cos, sin, positions, None, None, 0.0, store)[0]


def qk_norm_rotary_store(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    store: KVStore,
) -> torch.Tensor:
    """qk_norm_rotary, with the result's k and store.v written into the paged KV cache (as
    `store_kv`) instead of returned: returns q only."""
    return _launch(q, k, cos, sin, positions, q_weight, k_weight, eps, store)[0]
