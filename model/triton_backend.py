"""The CUDA attention backend: the project's Triton kernels behind the AttentionBackend
interface. Decode launches depend only on the batch size (a KV split count per batch size, a
preallocated workspace), so decode can be captured in a CUDA graph."""
from __future__ import annotations

import torch

from model.attention import AttentionMetadata
from model.decoder import AttentionBackend

MAX_KV_SPLITS = 64


def decode_split_policy(max_model_len: int, num_sms: int):
    """splits(batch, kv_heads): the decode KV split count. The base is about one split per 256
    tokens of the context limit (at most 16); a small batch takes more splits, up to about one
    per 64 tokens (at most MAX_KV_SPLITS), so that batch x kv_heads x splits fills the GPU
    (about two programs per SM): at batch 1 with 8 KV heads the base alone left most SMs idle.
    Always a power of two: each count is a kernel variant to compile (a handful, not one per
    batch size)."""
    import triton

    from model.kernels import num_kv_splits_for
    base = triton.next_power_of_2(num_kv_splits_for(max_model_len))
    # one split per 64 tokens of the limit, rounded up: the last splits may stay empty (cheap)
    cap = max(base, min(MAX_KV_SPLITS, triton.next_power_of_2(
        num_kv_splits_for(max_model_len, tokens_per_split=64, max_splits=MAX_KV_SPLITS))))

    def splits(batch: int, kv_heads: int) -> int:
        want = triton.next_power_of_2(triton.cdiv(2 * num_sms, batch * kv_heads))
        return min(cap, max(base, want))
    return splits


def make_triton_backend(max_batch: int, num_heads: int, head_dim: int, max_model_len: int,
                        device: torch.device) -> AttentionBackend:
    from model.kernels import extend_attention, paged_decode_attention, store_kv_cache
    splits_for = decode_split_policy(max_model_len,
                                     torch.cuda.get_device_properties(device).multi_processor_count)
    # one flat workspace for every batch size: the most rows x splits any batch asks for
    # (one KV head per rank is the worst case)
    rows = max(b * splits_for(b, 1) for b in range(1, max_batch + 1))
    part_out = torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(rows * num_heads, dtype=torch.float32, device=device)
    # per (batch, kv_heads): the split count and its workspace views, made once (eager decode
    # calls this once per layer per step)
    layouts: dict[tuple[int, int], tuple[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def layout(batch: int, kv_heads: int) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        splits = splits_for(batch, kv_heads)
        return splits, (part_out[:batch * num_heads * splits * head_dim].view(batch, num_heads, splits, head_dim),
                        part_lse[:batch * num_heads * splits].view(batch, num_heads, splits))

    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        key = (q.shape[0], k_cache.shape[2])
        if key not in layouts:
            layouts[key] = layout(*key)
        splits, workspace = layouts[key]
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      scale, num_kv_splits=splits, workspace=workspace)

    def extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return extend_attention(q, k_cache, v_cache, meta.query_start_loc, meta.context_lens,
                                meta.block_tables, meta.max_query_len, scale)

    return AttentionBackend(store=store_kv_cache, extend=extend, decode=decode)
