"""The decoder-only transformer shared by Qwen3, Qwen2 and Llama; their differences are config
(Qwen3: q/k RMSNorm per head; Qwen2: bias on q/k/v; Llama-3: rope scaling; attention_bias
and mlp_bias as transformers applies them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tapserve.model.attention import AttentionMetadata, reference_attention, store_kv
from tapserve.model.config import ModelConfig
from tapserve.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    TPGroup,
    VocabParallelEmbedding,
    split_evenly,
)
from tapserve.model.rotary import RotaryEmbedding, rotary_into_cache, rotary_with_qk_norm

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]
StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class AttentionBackend:
    """How attention reads and writes the paged cache: (store, prefill/extend, decode).
    store_in_rotary: the store may instead be done by the rotary kernel, where it applies
    (`model.rotary.rotary_into_cache`, which writes as `model.attention.store_kv` does); a
    backend whose store does anything else (quantises, records) must leave it False."""

    store: StoreFn = store_kv
    extend: AttentionFn = reference_attention
    decode: AttentionFn = reference_attention
    store_in_rotary: bool = False


@dataclass
class ForwardContext:
    """Passed explicitly down the model for one step: positions, paged-attention metadata and
    the per-layer KV caches."""

    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, backend: AttentionBackend, rotary: RotaryEmbedding
    ):
        super().__init__()
        self.backend = backend
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            tp,
            bias=cfg.attention_bias,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, tp, bias=cfg.o_proj_bias
        )
        self.rotary = rotary  # one table shared by every layer
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[layer]
        q = self._rotate_and_store(q, k, v, k_cache, v_cache, ctx)
        attend = self.backend.decode if ctx.attn.is_decode else self.backend.extend
        out = attend(q, k_cache, v_cache, ctx.attn, self.scale)
        return self.o_proj(out.flatten(1))

    def _rotate_and_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """Rotary (after q/k norm) on q and k, and k, v into the cache; returns q."""
        slots = ctx.attn.slot_mapping
        if self.backend.store_in_rotary:
            q_rot = rotary_into_cache(
                self.rotary,
                ctx.positions,
                q,
                k,
                v,
                self.q_norm,
                self.k_norm,
                k_cache,
                v_cache,
                slots,
            )
            if q_rot is not None:
                return q_rot
        if self.q_norm is not None:
            q, k = rotary_with_qk_norm(self.rotary, ctx.positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = self.rotary(ctx.positions, q, k)
        self.backend.store(k, v, k_cache, v_cache, slots)
        return q


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        split_evenly(cfg.intermediate_size, tp.size, "intermediate_size")  # names the field
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, tp, bias=cfg.mlp_bias
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, tp, bias=cfg.mlp_bias
        )
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPGroup, backend: AttentionBackend, rotary: RotaryEmbedding
    ):
        super().__init__()
        self.self_attn = Attention(cfg, tp, backend, rotary)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, ctx: ForwardContext, layer: int):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, ctx, layer)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """forward() returns final-normalized hidden states [T, hidden] (replicated on every rank);
    compute_logits() turns selected rows into full-vocab logits on rank 0 (None elsewhere)."""

    # HF checkpoint name fragment -> (our parameter name fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        cfg: ModelConfig,
        tp: TPGroup,
        backend: AttentionBackend | None = None,
        max_positions: int | None = None,
    ):
        super().__init__()
        backend = backend or AttentionBackend()
        self.config = cfg
        rotary = RotaryEmbedding(
            cfg.head_dim,
            max_positions or cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
        )
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, backend, rotary) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, ctx, i)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.compute_logits(hidden)
