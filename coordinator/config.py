"""EngineConfig: every start-up option of the engine, validated once, and the check of a
checkpoint against it (coordinator/startup.py builds and starts from it); EngineOptions: what
rank 0's engine takes of them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tapserve.coordinator.output_dispatch import check_workers as check_output_workers
from tapserve.coordinator.scheduler import SchedulerConfig
from tapserve.model.config import ModelConfig
from tapserve.model.loader import resolve_dtype
from tapserve.ranks.runner import check_block_size_and_load_format

DEFAULT_MAX_CUSTOM_OUTPUT_BYTES = 16 << 20  # one request's multi-row custom outputs


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint folder; None: the embedded demo model
    tokenizer: str | None = None
    dtype: str | None = None  # None/"auto": float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None: cuda if available else cpu
    load_format: str = "safetensors"
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB per rank
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: max_position_embeddings, capped to the KV cache
    enable_prefix_caching: bool = True
    custom_module: str | None = None  # None or "none" (as the flag spells it): no handler
    custom_output_reuse: str = "omit"
    output_workers: int = 0
    max_custom_output_bytes: int = DEFAULT_MAX_CUSTOM_OUTPUT_BYTES
    enforce_eager: bool = False
    seed: int = 0
    async_scheduling: bool | None = None  # None: on CUDA (coordinator/run_ahead.py)

    def __post_init__(self) -> None:
        if self.custom_module == "none":
            self.custom_module = None
        if self.custom_output_reuse not in ("omit", "recompute"):
            raise ValueError("custom_output_reuse must be omit or recompute")
        check_output_workers(self.output_workers)  # before any rank starts
        if self.max_custom_output_bytes < 0:
            raise ValueError(
                f"max_custom_output_bytes must be >= 0, got {self.max_custom_output_bytes}"
            )
        check_block_size_and_load_format(self.block_size, self.load_format)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_cache_memory is not None and not 0 < self.kv_cache_memory < float("inf"):
            raise ValueError(
                f"kv_cache_memory must be a positive number of GiB, got {self.kv_cache_memory}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if (
            self.device is not None
            and self.device != "cpu"
            and not re.fullmatch(r"cuda(:\d+)?", self.device)
        ):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if (
            self.device is not None
            and self.device.startswith("cuda")
            and not torch.cuda.is_available()
        ):
            raise ValueError(
                f"device {self.device}: torch sees no CUDA device (a CPU build of "
                f"torch {torch.__version__}, or no GPU visible)"
            )
        if not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit in 64 bits (signed), got {self.seed}")

    def model_dir(self) -> Path:
        if self.model is None:
            from tapserve.model.demo import ensure_demo_checkpoint

            return ensure_demo_checkpoint()
        path = Path(self.model)
        if not path.is_dir():
            raise FileNotFoundError(f"model folder not found: {path}")
        return path

    def torch_device(self, local_rank: int = 0) -> torch.device:
        if self.device == "cuda":
            return torch.device(f"cuda:{local_rank}")
        if self.device:
            return torch.device(self.device)
        return (
            torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        )


PLAN_POLL_SECONDS = 0.005  # ranks > 0 on GPUs poll for each plan this long before blocking


def check_model(config: EngineConfig) -> tuple[Path, ModelConfig]:
    """The checkpoint's folder and config, checked against the flags before anything loads:
    the model's architecture, the dtype and the context limit (a ValueError or OSError)."""
    model_dir = config.model_dir()
    model_cfg = ModelConfig.from_dir(model_dir)
    resolve_dtype(config.dtype, config.torch_device())
    limit = model_cfg.max_position_embeddings
    if config.max_model_len and config.max_model_len > limit:  # as vLLM, not capped
        raise ValueError(
            f"--max-model-len {config.max_model_len} exceeds the model's "
            f"max_position_embeddings ({limit}); leave it out or lower it"
        )
    return model_dir, model_cfg


@dataclass
class EngineOptions:
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    enable_prefix_caching: bool = True
    custom_output_reuse: str = "omit"  # or "recompute"
    seed: int = 0
    output_workers: int = 0  # custom-output dispatch threads (0 = serial)
    # a multi-row selection's bound: rows x custom_row_bytes (the dry run's) x max(n, beams)
    max_custom_output_bytes: int = DEFAULT_MAX_CUSTOM_OUTPUT_BYTES
    custom_row_bytes: int = 0
    # plain decode steps run ahead of their sampling (coordinator/run_ahead.py); None: on
    # CUDA, where it pays (the CPU computes synchronously anyway)
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.custom_output_reuse not in ("omit", "recompute"):
            raise ValueError("custom_output_reuse must be omit or recompute")
