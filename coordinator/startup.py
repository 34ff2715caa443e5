"""Start-up: building a rank's model runner and rank 0's engine from an EngineConfig, joining
the process group and leaving it."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from tapserve.api.detokenizer import Decoder
from tapserve.coordinator.config import PLAN_POLL_SECONDS, EngineConfig, EngineOptions, check_model
from tapserve.coordinator.custom_outputs import build_handler
from tapserve.coordinator.engine import Engine
from tapserve.coordinator.keepalive import PlanKeepalive
from tapserve.coordinator.scheduler import SchedulerConfig
from tapserve.model.layers import ParallelLayoutError, TPGroup
from tapserve.model.loader import resolve_dtype
from tapserve.ranks.group import DistContext, PlanChannel, init_distributed, shutdown_distributed
from tapserve.ranks.plan import StepKind, StepPlan
from tapserve.ranks.runner import ModelRunner, RankAgreedError, RunnerConfig
from tapserve.ranks.worker import ignore_termination_signals


def build_runner(
    config: EngineConfig,
    tp: TPGroup = TPGroup(),
    device: torch.device | None = None,
    min_across_ranks: Callable[[int], int] = lambda x: x,
) -> ModelRunner:
    model_dir, model_cfg = check_model(config)
    device = device or config.torch_device()
    max_len = config.max_model_len or model_cfg.max_position_embeddings
    runner_cfg = RunnerConfig(
        model_dir=model_dir,
        dtype=resolve_dtype(config.dtype, device),
        device=device,
        load_format=config.load_format,
        block_size=config.block_size,
        kv_cache_memory_gib=config.kv_cache_memory,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_kv_blocks=config.num_kv_blocks,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enforce_eager=config.enforce_eager,
        seed=config.seed,
    )
    try:
        runner = ModelRunner(model_cfg, runner_cfg, tp, min_across_ranks)
    except RuntimeError as e:  # (torch.OutOfMemoryError is one)
        if not _out_of_memory(e):
            raise
        raise ValueError(
            f"start-up ran out of memory on {device} ({_allocation(e)}): lower "
            f"--kv-cache-memory or --num-kv-blocks (--gpu-memory-utilization "
            f"on GPUs), --max-num-seqs or --max-num-batched-tokens"
        ) from None
    capacity = runner.num_blocks * runner_cfg.block_size
    if config.max_model_len and config.max_model_len > capacity:  # (unset: the engine caps it)
        raise RankAgreedError(
            f"--max-model-len {config.max_model_len} does not fit the KV cache, "
            f"{runner.num_blocks} blocks of {runner_cfg.block_size} tokens ({capacity}): give "
            f"the cache more room (--kv-cache-memory, --gpu-memory-utilization, "
            f"--num-kv-blocks) or lower --max-model-len"
        )
    return runner


def _out_of_memory(e: RuntimeError) -> bool:
    """Whether torch failed to allocate: CUDA's OutOfMemoryError, or the CPU allocator's
    RuntimeError (which has no class of its own)."""
    return isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)


def _allocation(e: RuntimeError) -> str:
    """The size an allocation failure names, in GiB, else its message's first line."""
    asked = re.search(r"allocate (\d+) bytes|Tried to allocate ([\d.]+ [KMGT]iB)", str(e))
    if asked is None:
        return str(e).splitlines()[0][:200]
    return f"{int(asked[1]) / 2**30:.1f} GiB asked" if asked[1] else f"{asked[2]} asked"


def build_engine(
    config: EngineConfig,
    runner: ModelRunner,
    channel: PlanChannel | None = None,
    text_decoder: Decoder | None = None,
) -> Engine:
    """Rank 0 only: the coordinator's engine around this rank's runner (and the handler).
    text_decoder: the serving tokenizer (see Engine)."""
    model_cfg = runner.model_cfg
    handler, row_bytes = None, 0
    if config.custom_module:
        handler, row_bytes = build_handler(
            config.custom_module,
            runner.cfg.model_dir,
            runner.device,
            runner.cfg.dtype,
            model_cfg.hidden_size,
        )
    options = EngineOptions(
        max_model_len=runner.cfg.max_model_len,
        eos_token_ids=model_cfg.eos_token_ids,
        vocab_size=model_cfg.vocab_size,
        scheduler=SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
        enable_prefix_caching=config.enable_prefix_caching,
        custom_output_reuse=config.custom_output_reuse,
        seed=config.seed,
        output_workers=config.output_workers,
        max_custom_output_bytes=config.max_custom_output_bytes,
        custom_row_bytes=row_bytes,
        async_scheduling=config.async_scheduling,
    )
    keepalive = None
    if channel is not None and handler is not None:
        keepalive = PlanKeepalive(
            lambda: channel.send(StepPlan(kind=StepKind.HEARTBEAT)), lambda: channel.last_sent
        )
    return Engine(
        runner,
        options,
        handler,
        channel.send if channel else (lambda plan: None),
        text_decoder,
        keepalive,
    )


def start_rank(
    config: EngineConfig, expected_tp: int | None = None
) -> tuple[DistContext, ModelRunner, PlanChannel | None]:
    """Join the process group (torchrun's environment, or none for one process), build this
    rank's runner and, with several ranks, the plan channel. Ranks other than 0 ignore
    SIGINT/SIGTERM: rank 0 alone decides when to stop."""
    ctx = init_distributed(config.torch_device().type)
    if expected_tp is not None and expected_tp != ctx.world_size:
        raise ParallelLayoutError(
            f"--tp {expected_tp} does not match the number of ranks started ({ctx.world_size}): "
            f"leave --tp out (it defaults to that number) or start {expected_tp} ranks "
            f"(torchrun --nproc-per-node={expected_tp}, or launch.py --nproc-per-node {expected_tp})"
        )
    if not ctx.is_driver:
        ignore_termination_signals()
    runner = build_runner(config, ctx.tp, config.torch_device(ctx.local_rank), ctx.min_across_ranks)
    if ctx.world_size == 1:
        return ctx, runner, None
    # on GPUs a rank has a CPU core to spare: polling saves a blocked thread's wake-up on
    # every plan (bench/plan_broadcast.py --spin-ms); on CPU it would take the forward's cores
    spin_s = PLAN_POLL_SECONDS if runner.device.type == "cuda" else 0.0
    return ctx, runner, PlanChannel(ctx.plan_group, spin_s=spin_s)


def rank0_engine(config: EngineConfig) -> tuple[DistContext, Engine, PlanChannel | None] | None:
    """For scripts run under torchrun (benchmarks, tests): join the group; ranks other than 0
    run the worker loop until the stop plan, leave the group and get None; rank 0 gets its
    engine. Rank 0 ends the group with `stop_group(channel)`."""
    from tapserve.ranks.worker import run_worker

    ctx, runner, channel = start_rank(config)
    if not ctx.is_driver:
        run_worker(runner, channel)
        shutdown_distributed()
        return None
    return ctx, build_engine(config, runner, channel), channel


def stop_group(channel: PlanChannel | None, timeout_s: float | None = None) -> None:
    """Rank 0: send the stop plan (with several ranks) and leave the group. timeout_s bounds
    the send (PlanChannel.send): a RuntimeError past it, and the group is not left."""
    if channel:
        channel.send(StepPlan(kind=StepKind.STOP), timeout_s)
    shutdown_distributed()
