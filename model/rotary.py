"""Rotary position embedding (rotate-half layout, as in HF Llama/Qwen), incl. Llama-3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from tapserve.model.layers import use_triton


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = (
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
    )
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, Hkv, D] at the given positions [T]."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if _kernel_ok(q, k):
            from tapserve.model.kernels.rotary import apply_rotary

            return apply_rotary(q, k, self.cos, self.sin, positions)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _kernel_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The Triton rotary kernel takes CUDA q/k of one dtype with a power-of-two head_dim."""
    d = q.shape[-1]
    return use_triton(q) and k.dtype == q.dtype and d >= 2 and d & (d - 1) == 0


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def _fused_norm_ok(q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module) -> bool:
    """The fused q/k norm + rotary kernel takes bf16 and fp32 (fp16 keeps the unfused kernels:
    their two roundings are what the fp16 checks pin down), with norm weights of q's dtype."""
    return (
        _kernel_ok(q, k)
        and q.dtype != torch.float16
        and q_norm.weight.dtype == q.dtype
        and k_norm.weight.dtype == q.dtype
        and q_norm.eps == k_norm.eps
    )


def rotary_with_qk_norm(
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: nn.Module,
    k_norm: nn.Module,
):
    """Qwen3: per-head RMSNorm of q and k, then RoPE. CUDA: one fused Triton kernel when
    _fused_norm_ok; otherwise (and always on CPU) q_norm, k_norm, rotary."""
    if _fused_norm_ok(q, k, q_norm, k_norm):
        from tapserve.model.kernels.rotary import qk_norm_rotary

        return qk_norm_rotary(
            q, k, q_norm.weight, k_norm.weight, q_norm.eps, rotary.cos, rotary.sin, positions
        )
    return rotary(positions, q_norm(q), k_norm(k))


def rotary_into_cache(
    rotary: RotaryEmbedding,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: nn.Module | None,
    k_norm: nn.Module | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor | None:
    """Rotary (after Qwen3's q/k norm when q_norm is given) with the KV-cache store in the same
    Triton kernel: k rotated and v written to their slots, q rotated returned. None where that
    kernel does not apply (CPU; the cases rotary and rotary_with_qk_norm keep unfused; a cache
    of another dtype), and the caller rotates and stores as two steps."""
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        return None
    from tapserve.model.kernels.rotary import KVStore

    if q_norm is None and _kernel_ok(q, k):
        from tapserve.model.kernels.rotary import rotary_store

        return rotary_store(
            q, k, rotary.cos, rotary.sin, positions, KVStore(v, k_cache, v_cache, slot_mapping)
        )
    if q_norm is not None and _fused_norm_ok(q, k, q_norm, k_norm):
        from tapserve.model.kernels.rotary import qk_norm_rotary_store

        return qk_norm_rotary_store(
            q,
            k,
            q_norm.weight,
            k_norm.weight,
            q_norm.eps,
            rotary.cos,
            rotary.sin,
            positions,
            KVStore(v, k_cache, v_cache, slot_mapping),
        )
    return None
