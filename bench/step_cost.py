"""What one engine step reads and computes on a rank, from the model's shapes and the step's
plan: the bytes and FLOPs of DESIGN.md's roofline, each step's floor max(bytes / B, FLOPs / F)
(B and F from bench/roofline.py, measured in the same run).

Bytes: every weight once (the embedding only when tied to the LM head: its rows for the batch
are negligible) and the KV of every token a sequence attends to. FLOPs: 2 per weight per token
for the layers, 2 per LM-head weight per sampled row, and attention's 4 per query head, head
dimension and (query, key) pair under the causal mask (QK^T, PV).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tapserve.bench import roofline

if TYPE_CHECKING:
    import torch

    from tapserve.model.config import ModelConfig
    from tapserve.ranks.plan import StepPlan
    from tapserve.ranks.runner import ModelRunner

_HEAD_NAMES = ("lm_head.weight", "embed_tokens.weight")  # the latter when tied


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # read once a step
    layer_params: int  # applied to every token of the step (norms included)
    head_params: int  # the LM head's, applied to the rows sampled
    kv_bytes_per_token: int
    attention_flops_per_pair: int  # 4 x layers x query heads (this rank's) x head_dim

    @classmethod
    def of(cls, runner: ModelRunner) -> ModelCost:
        """The cost model of a built runner (this rank's shard)."""
        kv_bytes_per_token = runner.block_bytes() // runner.cfg.block_size
        return cls.of_model(runner.model, runner.model_cfg, runner.tp.size, kv_bytes_per_token)

    @classmethod
    def of_model(
        cls, model: torch.nn.Module, cfg: ModelConfig, tp_size: int, kv_bytes_per_token: int
    ) -> ModelCost:
        weight_bytes = layer_params = head_params = 0
        for name, p in model.named_parameters():
            if name == "embed_tokens.weight" and not cfg.tie_word_embeddings:
                continue
            weight_bytes += p.numel() * p.element_size()
            if name in _HEAD_NAMES:
                head_params += p.numel()
            else:
                layer_params += p.numel()
        heads = cfg.num_attention_heads // tp_size
        return cls(
            weight_bytes=weight_bytes,
            layer_params=layer_params,
            head_params=head_params,
            kv_bytes_per_token=kv_bytes_per_token,
            attention_flops_per_pair=4 * cfg.num_hidden_layers * heads * cfg.head_dim,
        )

    def step_bytes(self, plan: StepPlan) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * float(plan.context_lens.sum())

    def step_flops(self, plan: StepPlan) -> float:
        queries = np.diff(plan.query_start_loc).astype(np.float64)
        context = plan.context_lens.astype(np.float64)
        # query j of q (at position c - q + j) attends to c - q + j + 1 keys: q c - q (q - 1) / 2
        pairs = float((queries * context - queries * (queries - 1) / 2).sum())
        return (
            2.0 * self.layer_params * plan.num_tokens
            + 2.0 * self.head_params * len(plan.logit_rows)
            + float(self.attention_flops_per_pair) * pairs
        )

    def step_floor(self, plan: StepPlan, bytes_per_s: float, flops_per_s: float) -> float:
        return roofline.step_floor(
            self.step_bytes(plan), self.step_flops(plan), bytes_per_s, flops_per_s
        )

    def decode_flops(self, batch: int, mean_context: float) -> float:
        """A decode step of `batch` rows, each attending to `mean_context` tokens."""
        params = self.layer_params + self.head_params
        return batch * (2.0 * params + self.attention_flops_per_pair * mean_context)
