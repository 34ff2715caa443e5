"""The per-rank model runner: plan -> tensors -> forward. Identical on every rank; only rank 0
uses the logits and the hidden states of `custom_rows`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tapserve.cuda_graphs.decode import DecodeGraphs
from tapserve.model.allreduce import MODES, mode_from_env, with_one_shot_all_reduce
from tapserve.model.attention import AttentionMetadata
from tapserve.model.config import ModelConfig
from tapserve.model.decoder import AttentionBackend, ForwardContext
from tapserve.model.layers import TPGroup, gemv_max_rows_from_env
from tapserve.model.loader import build_model, init_dummy_weights, load_weights
from tapserve.model.triton_backend import make_triton_backend
from tapserve.ranks.plan import StepKind, StepPlan

GiB = 1 << 30
BLOCK_SIZES = (8, 16, 32, 64, 128)  # KV block sizes (tokens) the attention kernels take
LOAD_FORMATS = ("safetensors", "dummy")


@dataclass
class RunnerConfig:
    model_dir: Path | None
    dtype: torch.dtype
    device: torch.device
    load_format: str = "safetensors"  # or "dummy"
    block_size: int = 16
    kv_cache_memory_gib: float | None = None  # None: CPU 2 GiB, CUDA from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # exact block count (tests); overrides the memory budget
    max_num_seqs: int = 256
    max_model_len: int = 4096
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = False
    seed: int = 0
    all_reduce: str = field(default_factory=mode_from_env)  # TAPSERVE_ALLREDUCE (model/allreduce)

    def __post_init__(self) -> None:
        if self.all_reduce not in MODES:
            raise ValueError(
                f"all_reduce (TAPSERVE_ALLREDUCE) must be one of {', '.join(MODES)}, "
                f"got {self.all_reduce!r}"
            )
        check_block_size_and_load_format(self.block_size, self.load_format)
        gemv_max_rows_from_env()  # (model.layers read it at import, leniently)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


def check_block_size_and_load_format(block_size: int, load_format: str) -> None:
    """ValueError unless the runner takes both."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size}"
        )
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}"
        )


class RankAgreedError(ValueError):
    """A start-up error every rank of a node finds alike (flags, checkpoint files, agreed
    values): launch.py prints it once per node."""


HOST_HEADROOM_BYTES = GiB  # with a tenth of the available memory: weights, buffers, the API


def _host_memory_available() -> int:
    """The host's available memory in bytes (Linux's MemAvailable; else physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class StepOutput:
    hidden: torch.Tensor  # [T, hidden] final-normalized
    logits: torch.Tensor | None  # [len(logit_rows), vocab] on rank 0, else None


class ModelRunner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: RunnerConfig,
        tp: TPGroup,
        min_across_ranks: Callable[[int], int] = lambda x: x,
        backend: AttentionBackend | None = None,
        show_progress: bool = True,
    ):
        # collective when switched on: every rank, before the model and the graphs capture tp
        tp = with_one_shot_all_reduce(
            tp,
            cfg.all_reduce,
            cfg.device,
            cfg.dtype,
            cfg.max_num_seqs * model_cfg.hidden_size * cfg.dtype.itemsize,
        )
        self.model_cfg, self.cfg, self.tp = model_cfg, cfg, tp
        self.device = cfg.device
        if backend is None and cfg.device.type == "cuda":
            backend = make_triton_backend(
                cfg.max_num_seqs,
                model_cfg.num_attention_heads // tp.size,
                model_cfg.head_dim,
                cfg.max_model_len,
                cfg.device,
            )
        self.model = build_model(model_cfg, tp, cfg.dtype, cfg.device, backend, cfg.max_model_len)
        if cfg.load_format == "dummy":
            init_dummy_weights(self.model, cfg.seed)
        else:
            try:
                load_weights(self.model, Path(cfg.model_dir), show_progress and tp.rank == 0)
            except (ValueError, OSError) as e:  # the node's checkpoint files: alike on each rank
                raise RankAgreedError(str(e)) from None
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads
        self.num_blocks = min_across_ranks(self._count_kv_blocks())
        if self.num_blocks < 1:
            raise RankAgreedError("KV cache budget is too small for a single block")
        if cfg.device.type == "cpu":
            self._check_host_memory(min_across_ranks(_host_memory_available()))
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        # ranks > 0: where a step scheduled ahead receives its ids from rank 0 (ids_from_rank0)
        self._rank0_ids = torch.zeros(
            cfg.max_num_seqs if tp.rank > 0 else 0, dtype=torch.int64, device=cfg.device
        )
        self.graphs: DecodeGraphs | None = None
        if cfg.device.type == "cuda" and not cfg.enforce_eager:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                cfg.max_num_seqs,
                -(-cfg.max_model_len // cfg.block_size),
                cfg.device,
            )
            self.graphs.capture()

    def graph_bucket_for(self, plan: StepPlan) -> int:
        """Rank 0 decides, per plan, which captured decode graph every rank replays."""
        if self.graphs is None or plan.kind is not StepKind.DECODE:
            return -1
        return self.graphs.bucket_for(plan.num_seqs)

    def block_bytes(self) -> int:
        c = self.model_cfg
        elem = torch.empty(0, dtype=self.cfg.dtype).element_size()
        return 2 * c.num_hidden_layers * self.cfg.block_size * self.num_kv_heads * c.head_dim * elem

    def _count_kv_blocks(self) -> int:
        if self.cfg.num_kv_blocks is not None:
            return self.cfg.num_kv_blocks
        if self.cfg.kv_cache_memory_gib is not None:
            budget = int(self.cfg.kv_cache_memory_gib * GiB)
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = 2 * GiB
        useful = self.cfg.max_num_seqs * -(-self.cfg.max_model_len // self.cfg.block_size) + 1
        return int(min(budget // self.block_bytes(), useful))  # (0: checked once agreed)

    def _check_host_memory(self, available: int) -> None:
        """A CPU KV cache must fit the host's available memory with the node's other ranks'
        caches (beyond it, the OOM killer may end a rank silently)."""
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        need = self.num_blocks * self.block_bytes() * ranks
        room = available - HOST_HEADROOM_BYTES - available // 10  # the rest of the processes
        if need > room:
            raise RankAgreedError(
                f"the KV cache, {self.num_blocks} blocks ({need / GiB:.1f} GiB for {ranks} "
                f"rank(s) on this host), does not fit the host's available memory "
                f"({available / GiB:.1f} GiB, of which 1 GiB and a tenth are left to the "
                f"processes): lower --kv-cache-memory or --num-kv-blocks"
            )

    def _cuda_kv_budget(self) -> int:
        """Fraction of the GPU left after weights and a peak-activation profile run."""
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(self.device)
        peak_activations = self._profile_peak_activations()
        used_by_others = total - free
        return int(total * self.cfg.gpu_memory_utilization - used_by_others - peak_activations)

    def _profile_peak_activations(self) -> int:
        """The most memory a step's forward and logits take beyond the KV cache (profile_plans,
        each run on a scratch KV cache)."""
        peak = 0
        for plan in profile_plans(
            self.cfg.max_num_batched_tokens,
            self.cfg.max_model_len,
            self.cfg.max_num_seqs,
            self.cfg.block_size,
        ):
            caches = self._allocate_kv_cache(int(plan.block_tables.max()) + 1)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            self.execute(plan, caches)
            peak = max(peak, torch.cuda.max_memory_allocated(self.device) - before)
            del caches
            torch.cuda.empty_cache()
        return peak

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (num_blocks, self.cfg.block_size, self.num_kv_heads, self.model_cfg.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.cfg.dtype, device=self.device),
                torch.zeros(shape, dtype=self.cfg.dtype, device=self.device),
            )
            for _ in range(self.model_cfg.num_hidden_layers)
        ]

    @torch.inference_mode()
    def execute(
        self, plan: StepPlan, kv_caches=None, input_ids: torch.Tensor | None = None
    ) -> StepOutput | None:
        """Run plan (None for no tokens). input_ids: rank 0's ids on the device, in place of
        plan.input_ids (with plan.ids_from_rank0 at TP > 1, broadcast to every rank first)."""
        kv_caches = self.kv_caches if kv_caches is None else kv_caches
        self._copy_blocks(plan.block_copies, kv_caches)
        if plan.num_tokens == 0:
            return None
        if plan.ids_from_rank0 and self.tp.size > 1:
            input_ids = self._ids_from_rank0(plan.num_tokens, input_ids)
        if plan.graph_bucket >= 0:
            hidden = self.graphs.replay(plan, input_ids)
        else:
            ids = self._tensor(plan.input_ids) if input_ids is None else input_ids
            hidden = self.model(ids, self.forward_context(plan, kv_caches))
        logits = None
        if plan.logit_rows.size == hidden.shape[0]:  # every row (rows are sorted and distinct):
            logits = self.model.compute_logits(hidden)  # no index, no host copy mid-step
        elif plan.logit_rows.size:
            logits = self.model.compute_logits(hidden[self._tensor(plan.logit_rows)])
        return StepOutput(hidden, logits)

    def _ids_from_rank0(self, n: int, ids: torch.Tensor | None) -> torch.Tensor:
        """Rank 0's ids on every rank (others pass None): one broadcast in the GPU stream."""
        if self.tp.rank == 0:  # the source: sent as it lies
            return self.tp.broadcast_from_rank0(ids.contiguous())
        return self.tp.broadcast_from_rank0(self._rank0_ids[:n])

    def wait_idle(self, timeout: float) -> bool:
        """Wait, up to timeout seconds, until this rank's GPU has run every step launched so
        far; False if it has not (a collective waiting on a peer that is gone)."""
        if self.device.type != "cuda":
            return True
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + timeout
        while not done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def forward_context(self, plan: StepPlan, kv_caches) -> ForwardContext:
        attn = AttentionMetadata(
            slot_mapping=self._tensor(plan.slot_mapping),
            query_start_loc=self._tensor(plan.query_start_loc),
            context_lens=self._tensor(plan.context_lens),
            block_tables=self._tensor(plan.block_tables).to(torch.int32),
            is_decode=plan.kind is StepKind.DECODE,
            query_start_loc_host=plan.query_start_loc.tolist(),
            context_lens_host=plan.context_lens.tolist(),
        )
        return ForwardContext(self._tensor(plan.positions), attn, kv_caches)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

    @staticmethod
    def _copy_blocks(copies: np.ndarray, kv_caches) -> None:
        if not copies.size:
            return
        src = torch.from_numpy(copies[:, 0].copy()).to(kv_caches[0][0].device)
        dst = torch.from_numpy(copies[:, 1].copy()).to(kv_caches[0][0].device)
        for k_cache, v_cache in kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]


def profile_plans(
    max_tokens: int, max_model_len: int, max_seqs: int, block_size: int
) -> list[StepPlan]:
    """The prefill steps taking the most memory the scheduler can ask for: the longest one
    sequence, and a full token budget over as many sequences as may run (the most logits)."""
    longest = min(max_tokens, max_model_len)
    total = min(max_tokens, max_seqs * max_model_len)
    rows = min(max_seqs, total)
    spread = [total // rows + (i < total % rows) for i in range(rows)]
    return [_prefill_plan([longest], block_size), _prefill_plan(spread, block_size)]


def _prefill_plan(lengths: list[int], block_size: int) -> StepPlan:
    """A prefill of fresh sequences of these lengths, each in blocks of its own."""
    lens = np.asarray(lengths, np.int32)
    widths = -(-lens // block_size)
    first_block = np.concatenate([[0], np.cumsum(widths)[:-1]])
    tables = first_block[:, None] + np.arange(widths.max())[None]
    tables = np.where(np.arange(widths.max())[None] < widths[:, None], tables, 0)
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    positions = np.arange(starts[-1]) - np.repeat(starts[:-1], lens)
    slots = np.repeat(first_block * block_size, lens) + positions
    return StepPlan(
        kind=StepKind.PREFILL,
        input_ids=np.zeros(starts[-1], np.int64),
        positions=positions.astype(np.int64),
        slot_mapping=slots.astype(np.int64),
        query_start_loc=starts,
        context_lens=lens,
        block_tables=tables.astype(np.int32),
        logit_rows=(starts[1:] - 1).astype(np.int64),
    )
