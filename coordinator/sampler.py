"""Token sampling on rank 0: logit processors, then greedy or random choice, plus logprobs.

Random choice is the exponential race (argmax p_i / E_i, E_i ~ Exp(1)); a seeded row draws
the same tokens whatever else shares the batch. Logprobs are of the raw model distribution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tapserve.api.sampling_params import SamplingParams
from tapserve.model.layers import HAS_TRITON


def to_device(values, device: torch.device) -> torch.Tensor:
    """A small per-row list as a tensor on device; on CUDA through pinned memory, so the copy
    does not wait for the work queued on the GPU."""
    tensor = torch.tensor(values)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that mixes every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, sample: int, position: int) -> int:
    """The generator seed of one sample's draw at one output position of a seeded request;
    seeds equal modulo 2**64 are one seed, any two others give unrelated streams."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ sample) ^ position)


@dataclass
class SampleRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (a reference, not a copy)
    num_prompt_tokens: int
    eos_token_ids: list[int]
    seed_key: int = 0  # sample index within the request (different noise per sample)
    num_samples: int = 1  # draw this many tokens from the row (first step of n > 1)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class SampleResult:
    token_ids: list[list[int]]  # per row, num_samples tokens
    logprobs: list[list[float]]  # logprob of each sampled token (raw model distribution)
    top_logprobs: list[list[list[list]]] | None  # per row, per sample: [[id, logprob], ...]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._kernel_seeds = random.Random(seed)  # one kernel seed per sample_temperature call

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleResult:
        want_lp = any(r.params.logprobs for r in rows)
        raw = logits.float().clone() if want_lp else None
        logits = self.process(logits.float(), rows)
        expand = [i for i, r in enumerate(rows) for _ in range(r.num_samples)]
        keys = [(r, r.seed_key + k) for r in rows for k in range(r.num_samples)]
        if len(expand) != len(rows):
            logits = logits[torch.tensor(expand, device=logits.device)]
        seeds = {
            i: draw_seed(r.params.seed, key, r.num_output_tokens)
            for i, (r, key) in enumerate(keys)
            if r.params.seed is not None
        }
        chosen = self._choose(logits, [r.params for r, _ in keys], seeds)
        flat_ids = chosen.tolist()  # the step's one host sync
        lp, top = self._logprobs(raw, expand, chosen, rows, keys) if want_lp else (None, None)
        token_ids, logprobs, tops, j = [], [], [] if top else None, 0
        for r in rows:
            token_ids.append(flat_ids[j : j + r.num_samples])
            logprobs.append(lp[j : j + r.num_samples] if lp else [0.0] * r.num_samples)
            if top is not None:
                tops.append(top[j : j + r.num_samples])
            j += r.num_samples
        return SampleResult(token_ids, logprobs, tops)

    @torch.inference_mode()
    def greedy(self, logits: torch.Tensor) -> list[int]:
        """The argmax of each row: __call__'s pick for plain greedy rows."""
        return self.greedy_tensor(logits).tolist()

    @torch.inference_mode()
    def greedy_tensor(self, logits: torch.Tensor) -> torch.Tensor:
        """greedy's tokens as an int64 tensor on the logits' device, with no host sync."""
        logits = logits.detach().float()
        if logits.device.type == "cpu":
            return torch.from_numpy(logits.numpy().argmax(axis=1))
        return logits.argmax(dim=-1)

    @torch.inference_mode()
    def sample_plain(self, logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
        """One token per row with no logit processors, logprobs or seed, as __call__ draws it."""
        return self.plain_tensor(logits, params).tolist()

    @torch.inference_mode()
    def plain_tensor(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """sample_plain's tokens as an int64 tensor on the logits' device, with no host sync."""
        return self._choose(logits.float(), params, {})

    @torch.inference_mode()
    def sample_temperature(self, logits: torch.Tensor, temperatures: list[float]) -> list[int]:
        """sample_plain for rows that sample with a temperature alone (BatchDraw.TEMPERATURE)."""
        return self.temperature_tensor(logits, temperatures).tolist()

    @torch.inference_mode()
    def temperature_tensor(self, logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
        """sample_temperature's tokens as an int64 tensor on the logits' device, with no host
        sync (on CUDA one Triton pass)."""
        if logits.is_cuda and HAS_TRITON:
            from tapserve.model.kernels.sample import gumbel_sample

            return gumbel_sample(logits, temperatures, self._kernel_seeds.getrandbits(31))
        temps = to_device(temperatures, logits.device)[:, None]
        probs = (logits.float() / temps).softmax(dim=-1)
        return (probs / self._exponential_noise(probs)).argmax(dim=-1)

    def _exponential_noise(self, like: torch.Tensor) -> torch.Tensor:
        """Exp(1) noise shaped like `like`, from the shared generator."""
        noise = torch.empty_like(like)
        if noise.device.type == "cpu":
            return noise.uniform_(generator=self.generator).log_().neg_()  # ~4x exponential_
        return noise.exponential_(generator=self.generator)

    # ---- logit processors (only rows that ask for them pay) ----------------------------------
    def process(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                ids = [t for t in p.logit_bias if 0 <= t < vocab]
                vals = torch.tensor([p.logit_bias[t] for t in ids], device=logits.device)
                logits[i, ids] += vals
            if row.num_output_tokens < p.min_tokens:
                banned = [t for t in (row.eos_token_ids + p.stop_token_ids) if 0 <= t < vocab]
                logits[i, banned] = float("-inf")
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                self._penalize(logits[i], row)
        return logits

    @staticmethod
    def _penalize(row_logits: torch.Tensor, row: SampleRow) -> None:
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                device=row_logits.device,
                dtype=torch.long,
            )
            vals = row_logits[seen]
            row_logits[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            out = torch.tensor(row.output_token_ids, device=row_logits.device, dtype=torch.long)
            counts = torch.bincount(out, minlength=row_logits.shape[0]).to(row_logits.dtype)
            row_logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)

    # ---- choice --------------------------------------------------------------------------------
    def _choose(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: dict[int, int]
    ) -> torch.Tensor:
        """Row i's token under params[i]; a row in seeds draws its noise from its own
        generator seeded with seeds[i]."""
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        dev = logits.device
        temps = to_device([1.0 if g else p.temperature for g, p in zip(greedy, params)], dev)
        probs = self._filtered_probs(logits / temps[:, None], params)
        noise = self._exponential_noise(probs)
        for i, seed in seeds.items():
            if not greedy[i]:
                noise[i].exponential_(generator=torch.Generator(device=dev).manual_seed(seed))
        sampled = (probs / noise).argmax(dim=-1)
        if not any(greedy):
            return sampled
        return torch.where(to_device(greedy, dev), logits.argmax(dim=-1), sampled)

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            k = to_device(top_k, dev)
            ranks = torch.arange(vocab, device=dev)[None, :]
            sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
            sorted_probs = sorted_logits.softmax(dim=-1)
            # keep the smallest prefix whose mass reaches top_p (the crossing token stays)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs
            p = to_device(top_p, dev)[:, None]
            # a row with top_p 1 keeps all: its float32 mass can pass 1.0 before the tail
            drop = (before > p) & (p < 1.0)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if any(m > 0 for m in min_p):
            threshold = to_device(min_p, dev)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    # ---- logprobs --------------------------------------------------------------------------------
    @staticmethod
    def _logprobs(
        raw: torch.Tensor,
        expand: list[int],
        chosen: torch.Tensor,
        rows: list[SampleRow],
        keys: list,
    ) -> tuple[list[float], list | None]:
        if len(expand) != raw.shape[0]:
            raw = raw[torch.tensor(expand, device=raw.device)]
        logprobs = torch.log_softmax(raw, dim=-1)
        picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
        k = max(r.params.top_logprobs for r in rows)
        if k == 0:
            return picked, None
        vals, ids = logprobs.topk(k, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        top = [
            [
                [t, v]
                for t, v in zip(ids[i][: r.params.top_logprobs], vals[i][: r.params.top_logprobs])
            ]
            for i, (r, _) in enumerate(keys)
        ]
        return picked, top
