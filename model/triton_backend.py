"""The CUDA attention backend: the project's Triton kernels behind the AttentionBackend
interface. Decode launches depend only on the batch size (a KV split count per batch size, a
preallocated workspace), so decode can be captured in a CUDA graph. A prefill or mixed step
runs the extend kernel over its multi-row sequences and the decode kernel over its one-row
ones (ExtendSplit)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from model.attention import AttentionMetadata
from model.decoder import AttentionBackend

MAX_KV_SPLITS = 64
# decode programs (batch x KV heads x splits) to aim for, per SM: measured on one H200
# (bench/decode_attention.py, docs/benchmarks.md): fewer leave the memory system idle at
# small batches, more cut contexts into slivers whose partial outputs and merge cost more
# than they hide
PROGRAMS_PER_SM = 32
TOKENS_PER_SPLIT = 256  # of the context limit: the most splits a limit allows


def decode_split_policy(max_model_len: int, num_sms: int):
    """splits(batch, kv_heads): the decode KV split count, so that batch x kv_heads x splits
    makes up to PROGRAMS_PER_SM programs per SM (the power of two at or under it), at most
    one split per TOKENS_PER_SPLIT
    tokens of the context limit and at most MAX_KV_SPLITS. A large batch fills the GPU
    alone (batch 256 x 8 KV heads: 2 splits on 132 SMs); a small one takes more. Always a
    power of two: each count is a kernel variant to compile (a handful, not one per batch
    size). Fewer KV heads never mean fewer splits, so a workspace sized for one KV head
    fits every batch."""
    import triton

    from model.kernels import num_kv_splits_for
    cap = triton.next_power_of_2(num_kv_splits_for(
        max_model_len, tokens_per_split=TOKENS_PER_SPLIT, max_splits=MAX_KV_SPLITS))

    def splits(batch: int, kv_heads: int) -> int:
        want = max(1, PROGRAMS_PER_SM * num_sms // (batch * kv_heads))
        return min(cap, 1 << (want.bit_length() - 1))
    return splits


@dataclass
class ExtendSplit:
    """A non-decode step's attention work, derived once per step (and kept in the metadata's
    backend_state): the extend kernel's work list over the sequences with more than one query
    row, and the one-row sequences (the decoding rows of a mixed step), which go to the decode
    kernel. That kernel reads each KV head once for its whole query group; the extend kernel
    would give every query head of such a row a program of BLOCK_M rows with one in use."""
    work: torch.Tensor  # [P, 2] int32, model.kernels.extend.extend_work
    decode_rows: torch.Tensor | None  # [Bd] int64: the one-row sequences' rows of q
    decode_tables: torch.Tensor | None  # [Bd, max_blocks] int32
    decode_lens: torch.Tensor | None  # [Bd] int32

    @classmethod
    def of(cls, meta: AttentionMetadata, block_m: int, device: torch.device) -> "ExtendSplit":
        from model.kernels.extend import extend_work
        starts = np.asarray(meta.query_start_loc_host or meta.query_start_loc.tolist())
        query_lens = np.diff(starts)
        one_row = np.flatnonzero(query_lens == 1)
        work = extend_work(query_lens, block_m, np.flatnonzero(query_lens > 1))
        work = torch.from_numpy(work).to(device, non_blocking=True)
        if not one_row.size:
            return cls(work, None, None, None)
        lens = np.asarray(meta.context_lens_host or meta.context_lens.tolist(), np.int32)[one_row]
        seqs = torch.from_numpy(one_row).to(device, non_blocking=True)
        return cls(work, torch.from_numpy(starts[one_row].astype(np.int64)).to(device, non_blocking=True),
                   meta.block_tables[seqs], torch.from_numpy(lens).to(device, non_blocking=True))


def make_triton_backend(max_batch: int, num_heads: int, head_dim: int, max_model_len: int,
                        device: torch.device) -> AttentionBackend:
    from model.kernels import extend_attention, paged_decode_attention, store_kv_cache
    from model.kernels.extend import extend_config
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

    def attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor,
                      scale: float) -> torch.Tensor:
        key = (q.shape[0], k_cache.shape[2])
        if key not in layouts:
            layouts[key] = layout(*key)
        splits, workspace = layouts[key]
        return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                      scale, num_kv_splits=splits, workspace=workspace)

    def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return attend_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)

    def extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        split = meta.backend_state.get("extend_split")
        if split is None:
            block_m = extend_config(k_cache.element_size(), head_dim)[0]
            split = meta.backend_state["extend_split"] = ExtendSplit.of(meta, block_m, q.device)
        out = extend_attention(q, k_cache, v_cache, meta.query_start_loc, meta.context_lens,
                               meta.block_tables, scale, work=split.work)
        if split.decode_rows is not None:
            out[split.decode_rows] = attend_decode(q[split.decode_rows], k_cache, v_cache,
                                                   split.decode_tables, split.decode_lens, scale)
        return out

    return AttentionBackend(store=store_kv_cache, extend=extend, decode=decode)
