"""The CUDA attention backend: the Triton kernels behind AttentionBackend. Decode launches
depend only on the batch size, so decode can be captured in a CUDA graph; a prefill or mixed
step sends its multi-row sequences to the extend kernel, its one-row ones to the decode kernel
(docs/kernels.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tapserve.model.attention import AttentionMetadata
from tapserve.model.decoder import AttentionBackend

MAX_KV_SPLITS = 64
PROGRAMS_PER_SM = 8  # decode programs (batch x KV heads x splits) to aim for, measured
TOKENS_PER_SPLIT = 256  # of the context limit: bounds the split count (see the policy)
MIN_SPLIT_TOKENS = 64  # the decode kernel's 16-bit BLOCK_N: no split reads fewer tokens


def decode_split_policy(max_model_len: int, num_sms: int) -> Callable[[int, int], int]:
    """splits(batch, kv_heads): the decode KV split count, a power of two: the most that keep
    batch x kv_heads x splits within PROGRAMS_PER_SM per SM, capped by the context limit
    (TOKENS_PER_SPLIT a split) and MAX_KV_SPLITS, but never fewer than fill every SM where a
    context at the limit has MIN_SPLIT_TOKENS a split (docs/kernels.md). Fewer KV heads never
    mean fewer splits, so a workspace sized for one KV head fits every batch."""
    import triton

    from tapserve.model.kernels import num_kv_splits_for

    def limit_splits(tokens_per_split: int) -> int:
        return triton.next_power_of_2(
            num_kv_splits_for(
                max_model_len, tokens_per_split=tokens_per_split, max_splits=MAX_KV_SPLITS
            )
        )

    cap, usable = limit_splits(TOKENS_PER_SPLIT), limit_splits(MIN_SPLIT_TOKENS)

    def power_of_two_within(programs: int, batch: int, kv_heads: int) -> int:
        most = max(1, programs // (batch * kv_heads))
        return 1 << (most.bit_length() - 1)

    def splits(batch: int, kv_heads: int) -> int:
        want = min(cap, power_of_two_within(PROGRAMS_PER_SM * num_sms, batch, kv_heads))
        every_sm = min(usable, power_of_two_within(num_sms, batch, kv_heads))
        return max(want, every_sm)

    return splits


class DecodeWorkspace:
    """The decode kernel's split count per batch shape and one flat workspace for all batches
    up to max_batch; views made once per (batch, kv_heads)."""

    def __init__(
        self,
        max_batch: int,
        num_heads: int,
        head_dim: int,
        splits_for: Callable[[int, int], int],
        device: torch.device,
    ):
        self.num_heads, self.head_dim, self.splits_for = num_heads, head_dim, splits_for
        rows = max(b * splits_for(b, 1) for b in range(1, max_batch + 1))
        self.part_out = torch.empty(rows * num_heads * head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(rows * num_heads, dtype=torch.float32, device=device)
        self.layouts: dict[tuple[int, int], tuple[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def layout(self, batch: int, kv_heads: int) -> tuple[int, tuple[torch.Tensor, torch.Tensor]]:
        """(splits, (partial_out, partial_lse)) for this batch shape."""
        key = (batch, kv_heads)
        if key not in self.layouts:
            splits, h, d = self.splits_for(batch, kv_heads), self.num_heads, self.head_dim
            out = self.part_out[: batch * h * splits * d].view(batch, h, splits, d)
            lse = self.part_lse[: batch * h * splits].view(batch, h, splits)
            self.layouts[key] = splits, (out, lse)
        return self.layouts[key]

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        seq_order: torch.Tensor | None,
    ) -> torch.Tensor:
        from tapserve.model.kernels import paged_decode_attention

        splits, workspace = self.layout(q.shape[0], k_cache.shape[2])
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            scale,
            num_kv_splits=splits,
            workspace=workspace,
            seq_order=seq_order,
        )


@dataclass
class ExtendSplit:
    """A non-decode step's attention work, derived once per step (kept in backend_state): the
    extend kernel's work list over the multi-row sequences, and the one-row sequences, which
    go to the decode kernel."""

    work: torch.Tensor  # [P, 2] int32, model.kernels.extend.extend_work
    decode_rows: torch.Tensor | None  # [Bd] int64: the one-row sequences' rows of q
    decode_tables: torch.Tensor | None  # [Bd, max_blocks] int32
    decode_lens: torch.Tensor | None  # [Bd] int32
    decode_order: torch.Tensor | None  # [Bd] int32, longest context first

    @classmethod
    def of(cls, meta: AttentionMetadata, block_m: int, device: torch.device) -> ExtendSplit:
        from tapserve.model.kernels.extend import extend_work

        def on_device(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        starts = np.asarray(meta.query_start_loc_host or meta.query_start_loc.tolist())
        query_lens = np.diff(starts)
        one_row = np.flatnonzero(query_lens == 1)
        work = on_device(extend_work(query_lens, block_m, np.flatnonzero(query_lens > 1)))
        if not one_row.size:
            return cls(work, None, None, None, None)
        lens = np.asarray(meta.context_lens_host or meta.context_lens.tolist(), np.int32)[one_row]
        tables = meta.block_tables[on_device(one_row)]
        return cls(
            work,
            on_device(starts[one_row].astype(np.int64)),
            tables,
            on_device(lens),
            on_device(np.argsort(-lens, kind="stable").astype(np.int32)),
        )


def make_triton_backend(
    max_batch: int,
    num_heads: int,
    head_dim: int,
    max_model_len: int,
    device: torch.device,
    num_sms: int | None = None,
) -> AttentionBackend:
    """num_sms: the device's, unless given (the CPU interpreter has none)."""
    from tapserve.model.kernels import extend_attention, longest_first, store_kv_cache
    from tapserve.model.kernels.extend import extend_config

    if num_sms is None:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    decoder = DecodeWorkspace(
        max_batch, num_heads, head_dim, decode_split_policy(max_model_len, num_sms), device
    )

    def decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # once per step (per CUDA-graph replay), on the device: the first layer sorts
        if "decode_order" not in meta.backend_state:
            meta.backend_state["decode_order"] = longest_first(meta.context_lens)
        return decoder.attend(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            scale,
            meta.backend_state["decode_order"],
        )

    def extend(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        block_m = extend_config(k_cache.element_size(), head_dim)[0]
        split = meta.backend_state.get(("extend_split", block_m))
        if split is None:
            split = meta.backend_state[("extend_split", block_m)] = ExtendSplit.of(
                meta, block_m, q.device
            )
        out = extend_attention(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.context_lens,
            meta.block_tables,
            scale,
            work=split.work,
        )
        if split.decode_rows is not None:
            out[split.decode_rows] = decoder.attend(
                q[split.decode_rows],
                k_cache,
                v_cache,
                split.decode_tables,
                split.decode_lens,
                scale,
                split.decode_order,
            )
        return out

    return AttentionBackend(
        store=store_kv_cache, extend=extend, decode=decode, store_in_rotary=True
    )
