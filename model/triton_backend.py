"""The CUDA attention backend: the project's Triton kernels behind the AttentionBackend
interface. Decode launches depend only on the batch size (fixed KV splits, a preallocated
workspace), so decode can be captured in a CUDA graph."""
from __future__ import annotations

import torch

from model.attention import AttentionMetadata
from model.decoder import AttentionBackend


def make_triton_backend(max_batch: int, num_heads: int, head_dim: int, max_model_len: int,
                        device: torch.device) -> AttentionBackend:
    from model.kernels import (extend_attention, make_decode_workspace, num_kv_splits_for,
                               paged_decode_attention, store_kv_cache)
    splits = num_kv_splits_for(max_model_len)
    workspace = make_decode_workspace(max_batch, num_heads, head_dim, splits, device)

    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      scale, num_kv_splits=splits, workspace=workspace)

    def extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return extend_attention(q, k_cache, v_cache, meta.query_start_loc, meta.context_lens,
                                meta.block_tables, meta.max_query_len, scale)

    return AttentionBackend(store=store_kv_cache, extend=extend, decode=decode)
