"""Paged attention: the per-step metadata, the KV-cache store and the torch reference backend.

Per layer, k_cache and v_cache are [num_blocks, block_size, num_kv_heads, head_dim]; token t
of a sequence has flat slot block_table[t // block_size] * block_size + t % block_size, and a
slot of -1 writes nowhere (padded rows of a CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's packed batch (tensors on the model device).

    Tokens of all sequences are packed along dim 0. Sequence i owns query rows
    query_start_loc[i]:query_start_loc[i+1]; those are its last query_len tokens, so its
    cached prefix is context_lens[i] - query_len tokens long.
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32, prefix + new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    is_decode: bool  # every sequence has query_len == 1
    # host copies, for what a backend plans on the host
    query_start_loc_host: list[int] | None = None
    context_lens_host: list[int] | None = None
    # what a backend derives once per step and reuses in every layer, filled on first use
    backend_state: dict[object, object] = field(default_factory=dict)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k, v [T, kv_heads, head_dim] into their slots; rows with slot -1 are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid])


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [T, heads, head_dim] over each sequence's cached K/V (which
    already holds this step's keys). Plain torch, one sequence at a time."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    starts = meta.query_start_loc_host or meta.query_start_loc.tolist()
    ctx_lens = meta.context_lens_host or meta.context_lens.tolist()
    for i, ctx_len in enumerate(ctx_lens):
        q_lo, q_hi = starts[i], starts[i + 1]
        if q_hi == q_lo:
            continue
        n_blocks = (ctx_len + block_size - 1) // block_size
        blocks = meta.block_tables[i, :n_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx_len]  # [ctx, kv_heads, d]
        v = v_cache[blocks].flatten(0, 1)[:ctx_len]
        out[q_lo:q_hi] = _causal_attention(q[q_lo:q_hi], k, v, scale)
    return out


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Lq, H, D] are the last Lq of the Lk positions in k/v [Lk, Hkv, D]."""
    q_len, k_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    q_pos = torch.arange(k_len - q_len, k_len, device=q.device)
    mask = torch.arange(k_len, device=q.device)[None, :] <= q_pos[:, None]  # [Lq, Lk]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)
