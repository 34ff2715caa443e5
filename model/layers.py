"""Tensor-parallel building blocks, named as in vLLM.

Every parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this
rank's slice of a full checkpoint tensor. With tp_size = 1 the slice is the whole tensor.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tapserve.model.kernels import GEMV_MAX_ROWS as GEMV_MAX_ROWS_LIMIT  # needs no Triton


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group (group=None: single process). one_shot:
    the symmetric-memory all-reduce for small messages (model/allreduce.py), or None."""

    rank: int = 0
    size: int = 1
    group: Any = None
    one_shot: Any = field(default=None, compare=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the group: x itself, summed in place, unless x came from
        `partial_sums` (then a new tensor)."""
        if self.size == 1:
            return x
        summed = None if self.one_shot is None else self.one_shot.reduce(x)
        if summed is None:
            dist.all_reduce(x, group=self.group)
            return x
        return summed

    def partial_sums(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where a producer should write a message all_reduce sums next (the one-shot
        all-reduce's buffer), or None for anywhere."""
        return None if self.one_shot is None else self.one_shot.staging(shape, dtype)

    def broadcast_from_rank0(self, x: torch.Tensor) -> torch.Tensor:
        """x as rank 0 has it, on every rank (in place)."""
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x

    def gather_to_rank0(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate each rank's [..., n] along the last dim on rank 0 (None elsewhere)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None


def _set_weight_loader(param: nn.Parameter, loader) -> None:
    param.weight_loader = loader


class ParallelLayoutError(ValueError):
    """A model or flag the ranks cannot split; every rank finds it alike, rank 0 reports it."""


def split_evenly(n: int, d: int, what: str) -> int:
    """n / d; a ParallelLayoutError naming `what` unless d divides n."""
    if n % d:
        raise ParallelLayoutError(
            f"{what} ({n}) is not divisible by the tensor-parallel size ({d})"
        )
    return n // d


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), W split along the output dim; each rank holds out/tp rows."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.out_per_rank = split_evenly(out_features, tp.size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        _set_weight_loader(self.weight, self.weight_loader)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False)
            _set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        _check_full_shape(loaded, (self.out_per_rank * self.tp.size, *param.shape[1:]))
        shard = loaded.narrow(0, self.tp.rank * self.out_per_rank, self.out_per_rank)
        _copy_checked(param.data, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections (gate and up) stored as one matrix."""

    def __init__(self, in_features: int, out_sizes: list[int], tp: TPGroup, bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), tp, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        _check_full_shape(loaded, (self.out_sizes[shard_id], *param.shape[1:]))
        size = self.out_sizes[shard_id] // self.tp.size
        offset = sum(self.out_sizes[:shard_id]) // self.tp.size
        shard = loaded.narrow(0, self.tp.rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix. KV heads are split across ranks, or replicated
    (each rank holding one) when there are fewer KV heads than ranks."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: TPGroup,
        bias: bool = False,
    ):
        self.head_dim = head_dim
        self.num_heads = split_evenly(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = split_evenly(num_kv_heads, tp.size, "num_key_value_heads")
        elif tp.size % num_kv_heads:
            raise ParallelLayoutError(
                f"tensor-parallel size {tp.size} is not a multiple of "
                f"num_key_value_heads ({num_kv_heads})"
            )
        else:
            self.num_kv_heads = 1
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden, out, tp, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        heads = self.num_heads * self.tp.size if shard_id == "q" else self.total_kv_heads
        _check_full_shape(loaded, (heads * self.head_dim, *param.shape[1:]))
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp.rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size = kv_size
            # replicated KV: ranks share a head, rank r takes head r * kv_heads // tp
            index = (
                self.tp.rank * self.total_kv_heads // self.tp.size
                if self.total_kv_heads < self.tp.size
                else self.tp.rank
            )
        shard = loaded.narrow(0, index * size, size)
        _copy_checked(param.data.narrow(0, offset, size), shard)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) (+ b): W split along the input dim."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.in_per_rank = split_evenly(in_features, tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        _set_weight_loader(self.weight, self.weight_loader)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            _set_weight_loader(self.bias, _replicated_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        _check_full_shape(loaded, (param.shape[0], self.in_per_rank * self.tp.size))
        _copy_checked(
            param.data, loaded.narrow(1, self.tp.rank * self.in_per_rank, self.in_per_rank)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.partial_sums((*x.shape[:-1], self.weight.shape[0]), x.dtype)
        y = self.tp.all_reduce(linear(x, self.weight, out=out))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split into contiguous ranges, one per rank."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_per_rank = math.ceil(vocab_size / tp.size)
        self.vocab_start = tp.rank * self.vocab_per_rank
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden), requires_grad=False)
        _set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        n = max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))
        if loaded.shape[1:] != param.shape[1:] or loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"shape {tuple(loaded.shape)} does not match ({self.vocab_size}, {param.shape[1]})"
            )
        param.data[:n].copy_(loaded.narrow(0, self.vocab_start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_per_rank)
        out = F.embedding(local.clamp(0, self.vocab_per_rank - 1), self.weight)
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """LM head sharing the vocab split; full logits are gathered on rank 0 only."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_to_rank0(linear(hidden, self.weight))
        return None if logits is None else logits[..., : self.vocab_size]


def _find_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        return False


HAS_TRITON = _find_triton()  # constant after import: Triton hot-path kernels for CUDA tensors
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def gemv_max_rows_from_env() -> int:
    """Rows up to which 16-bit CUDA linears take the Triton GEMV: TAPSERVE_GEMV_MAX_ROWS (default
    1, 0 for off) within GEMV_MAX_ROWS_LIMIT; a ValueError unless an integer."""
    raw = os.environ.get("TAPSERVE_GEMV_MAX_ROWS", "1")
    try:
        return min(GEMV_MAX_ROWS_LIMIT, max(0, int(raw)))
    except ValueError:
        raise ValueError(
            f"TAPSERVE_GEMV_MAX_ROWS must be an integer (rows; 0 turns the GEMV off), got {raw!r}"
        ) from None


def _gemv_max_rows_or_default() -> int:
    try:
        return gemv_max_rows_from_env()
    except ValueError:
        return 1  # refused by RunnerConfig before any model runs; an import must not fail


GEMV_MAX_ROWS = _gemv_max_rows_or_default()


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton hot-path kernels handle x (CUDA, a supported dtype)."""
    return x.is_cuda and HAS_TRITON and x.dtype in _KERNEL_DTYPES


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear, into `out` when given (contiguous, the result's shape and dtype); few-row
    16-bit CUDA inputs take the Triton GEMV where gemv_config has a config for the weight."""
    k = x.shape[-1]
    if (
        use_triton(x)
        and x.dtype is not torch.float32
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and 0 < x.numel() <= GEMV_MAX_ROWS * k
    ):
        from tapserve.model.kernels.gemv import gemv, gemv_config

        config = gemv_config(weight.shape[0], k, x.numel() // k)
        if config is not None:
            return gemv(x, weight, bias, config, out=out)
    y = F.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        _set_weight_loader(self.weight, _replicated_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Plain norm, or (with residual) fused add + norm returning (normed, new residual)."""
        if use_triton(x) and (
            residual is None or (residual.dtype == x.dtype and residual.shape == x.shape)
        ):
            from tapserve.model.kernels.norm import fused_add_rms_norm, rms_norm

            if residual is None:
                return rms_norm(x, self.weight, self.eps)
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from tapserve.model.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _replicated_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    _copy_checked(param.data, loaded)


def _check_full_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """The checkpoint tensor (before this rank takes its slice) has the model's shape."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"shape {tuple(loaded.shape)} does not match expected {tuple(expected)}")


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape {tuple(src.shape)} does not match expected {tuple(dst.shape)}")
    dst.copy_(src)
