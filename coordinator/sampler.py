"""Token sampling on rank 0: logit processors, then greedy or random choice, plus logprobs.

Random choice uses the exponential race (argmax p_i / E_i with E_i ~ Exp(1)), so a seeded
row draws its noise from its own generator, keyed by (seed, sample index, output length):
the same tokens whatever else shares the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from coordinator.sampling_params import SamplingParams


@dataclass
class SampleRow:
    """What the sampler needs to know about one row of logits."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: list[int]
    seed_key: int = 0  # sample index within the request (different noise per sample)
    num_samples: int = 1  # draw this many tokens from the row (first step of n > 1)


@dataclass
class SampleResult:
    token_ids: list[list[int]]  # per row, num_samples tokens
    logprobs: list[list[float]]  # logprob of each sampled token (raw model distribution)
    top_logprobs: list[list[list[list]]] | None  # per row, per sample: [[id, logprob], ...]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.process(logits, rows)
        chosen = [self._choose(logits[i], row) for i, row in enumerate(rows)]
        logprobs = [raw_logprobs[i, c].tolist() for i, c in enumerate(chosen)]
        top = None
        if any(r.params.top_logprobs > 0 for r in rows):
            top = [self._top(raw_logprobs[i], r.params.top_logprobs, len(c))
                   for i, (r, c) in enumerate(zip(rows, chosen))]
        return SampleResult([c.tolist() for c in chosen], logprobs, top)

    # ---- logit processors ---------------------------------------------------------
    def process(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                vals = torch.tensor(list(p.logit_bias.values()), device=logits.device)
                valid = ids < logits.shape[1]
                logits[i, ids[valid]] += vals[valid]
            if len(row.output_token_ids) < p.min_tokens:
                banned = [t for t in (row.eos_token_ids + p.stop_token_ids) if t < logits.shape[1]]
                logits[i, banned] = float("-inf")
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                self._penalize(logits[i], row)
        return logits

    @staticmethod
    def _penalize(row_logits: torch.Tensor, row: SampleRow) -> None:
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                                device=row_logits.device, dtype=torch.long)
            vals = row_logits[seen]
            row_logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                           vals * p.repetition_penalty)
        if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            out = torch.tensor(row.output_token_ids, device=row_logits.device, dtype=torch.long)
            counts = torch.bincount(out, minlength=row_logits.shape[0]).to(row_logits.dtype)
            row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)

    # ---- choice ---------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
        p = row.params
        if p.greedy:
            return logits.argmax().repeat(row.num_samples)
        probs = self._filtered_probs(logits / p.temperature, p)
        picks = [self._race(probs, row, k) for k in range(row.num_samples)]
        return torch.stack(picks)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        if p.top_k > 0 and p.top_k < logits.shape[0]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the token crossing top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs

    def _race(self, probs: torch.Tensor, row: SampleRow, k: int) -> torch.Tensor:
        if row.params.seed is None:
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
        else:
            key = hash((row.params.seed, row.seed_key + k, len(row.output_token_ids))) & (2**63 - 1)
            gen = torch.Generator(device=probs.device).manual_seed(key)
            noise = torch.empty_like(probs).exponential_(generator=gen)
        return (probs / noise).argmax()

    @staticmethod
    def _top(logprobs: torch.Tensor, k: int, num_samples: int) -> list[list[list]]:
        if k == 0:
            return [[] for _ in range(num_samples)]
        vals, ids = torch.topk(logprobs, k)
        pairs = [[int(t), float(v)] for t, v in zip(ids.tolist(), vals.tolist())]
        return [pairs for _ in range(num_samples)]
