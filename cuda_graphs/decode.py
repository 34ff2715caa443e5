"""Decode steps captured as CUDA graphs, one per batch-size bucket (1, 2, 4, 8, then steps of
16 up to max_num_seqs), sharing one memory pool. A step of B sequences replays the smallest
bucket >= B; padded rows get slot -1 (their KV writes go nowhere) and a 1-token context.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tapserve.model.attention import AttentionMetadata
from tapserve.model.decoder import CausalLM, ForwardContext
from tapserve.ranks.plan import StepPlan


def graph_buckets(max_num_seqs: int) -> list[int]:
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.buckets = graph_buckets(max_num_seqs)
        n = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def bucket_for(self, num_seqs: int) -> int:
        """Index of the smallest bucket holding num_seqs, or -1 (run eagerly)."""
        for i, b in enumerate(self.buckets):
            if num_seqs <= b:
                return i
        return -1

    def _context(self, b: int) -> ForwardContext:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b],
            is_decode=True,
        )
        return ForwardContext(self.positions[:b], meta, self.kv_caches)

    @torch.inference_mode()
    def capture(self, before_each: Callable[[], None] = lambda: None) -> None:
        """Capture every bucket, largest first, each after an eager warm-up (Triton, NCCL)."""
        pool = None
        for b in reversed(self.buckets):
            before_each()
            self.model(self.input_ids[:b], self._context(b))
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # a fresh context: backend_state must be computed in the graph, not by the warm-up
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model(self.input_ids[:b], self._context(b))
            pool = pool or graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def replay(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: the rows' token ids on the device, in place of plan.input_ids."""
        b = self.buckets[plan.graph_bucket]
        n, width = plan.num_seqs, plan.block_tables.shape[1]
        if input_ids is None:
            self._load(self.input_ids, plan.input_ids, n)
        else:
            self.input_ids[:n].copy_(input_ids)
        self._load(self.positions, plan.positions, n)
        self._load(self.slot_mapping, plan.slot_mapping, n)
        self._load(self.context_lens, plan.context_lens, n)
        self.slot_mapping[n:b].fill_(-1)
        self.context_lens[n:b].fill_(1)
        # widened on the device: copy_ across devices would widen uint16 tables on the host
        tables = torch.from_numpy(plan.block_tables).to(self.device, non_blocking=True)
        self.block_tables[:n, :width].copy_(tables)
        self.graphs[b].replay()
        return self.outputs[b][:n]

    @staticmethod
    def _load(dst: torch.Tensor, src: np.ndarray, n: int) -> None:
        dst[:n].copy_(torch.from_numpy(src), non_blocking=True)
