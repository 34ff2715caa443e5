"""One TP degree of bench/tp_sweep.py, run under torchrun: every rank builds its shard; rank 0
drives the engine and writes the figures (batch-1 decode, TTFT, nano-vllm-style throughput,
KV memory per rank) to --json."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.api.sampling_params import SamplingParams  # noqa: E402
from tapserve.bench.offline import config_dir, print_step_profile, workload  # noqa: E402
from tapserve.bench.step_cost import ModelCost  # noqa: E402
from tapserve.coordinator.config import EngineConfig  # noqa: E402
from tapserve.coordinator.startup import rank0_engine, stop_group  # noqa: E402
from tapserve.ranks.plan import StepKind, StepPlan  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drain(engine) -> None:
    while engine.has_work():
        engine.step()


def batch1_decode(
    engine, device, context: int, steps: int, profile_steps: int = 0
) -> tuple[float, float]:
    """(ms a batch-1 decode step takes through the engine, the sequence's mean context over
    the timed steps, counted as bench/decode_sweep.py counts it)."""
    engine.add_request(
        "b1",
        [i % 1000 + 1 for i in range(context)],
        SamplingParams(max_new_tokens=steps + 8, temperature=0, ignore_eos=True),
    )
    for _ in range(4):
        engine.step()
    (sequence,) = engine.scheduler.running
    mean_context = len(sequence.token_ids) + steps / 2
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    elapsed = (time.perf_counter() - start) / steps
    if profile_steps:
        print_step_profile(engine, profile_steps)
    drain(engine)
    return elapsed * 1e3, mean_context


def batch1_plan(runner, context: int) -> StepPlan:
    """A batch-1 decode plan at `context` over blocks 0.. (the bench's KV is scratch)."""
    blocks = -(-context // runner.cfg.block_size)
    last = np.array([context - 1], np.int64)
    plan = StepPlan(
        kind=StepKind.DECODE,
        input_ids=np.array([1], np.int64),
        positions=last,
        slot_mapping=last,
        query_start_loc=np.array([0, 1], np.int32),
        context_lens=np.array([context], np.int32),
        block_tables=np.arange(blocks, dtype=np.int32)[None],
        logit_rows=np.array([0], np.int64),
    )
    plan.graph_bucket = runner.graph_bucket_for(plan)
    return plan


def plan_replay_ms(engine, device, context: int, steps: int, wait: bool) -> float:
    """One plan sent and run per step, without the coordinator: with `wait`, rank 0 waits
    for each step's greedy id on the host before sending the next plan (the sync a step
    needs); without, the host runs ahead and the figure is the ranks' GPU time per step."""
    plan, runner = batch1_plan(engine.runner, context), engine.runner
    for i in range(steps + 4):
        if i == 4:
            sync(device)
            start = time.perf_counter()
        engine.send_plan(plan)
        ids = runner.execute(plan).logits.argmax(-1)
        if wait:
            ids.tolist()
    sync(device)
    return (time.perf_counter() - start) / steps * 1e3


def ttft_ms(engine, device, prompt_len: int) -> float:
    sync(device)
    start = time.perf_counter()
    engine.add_request(
        "ttft",
        [i % 997 + 2 for i in range(prompt_len)],
        SamplingParams(max_new_tokens=1, temperature=0),
    )
    engine.step()
    sync(device)
    elapsed = time.perf_counter() - start
    drain(engine)
    return elapsed * 1e3


def throughput(engine, device, num_seqs: int, max_len: int) -> float:
    prompts, params = workload(num_seqs, max_len, max_len)
    vocab = engine.options.vocab_size
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"w{i}", [t % vocab for t in p], sp)
    sync(device)
    start = time.perf_counter()
    drain(engine)
    sync(device)
    return sum(sp.max_new_tokens for sp in params) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", required=True)
    p.add_argument("--device", default=None)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--json", required=True)
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="print torch.profiler's kernel time of this many batch-1 steps (rank 0)",
    )
    args = p.parse_args()
    config = EngineConfig(
        model=config_dir(args.model_config),
        load_format="dummy",
        device=args.device,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
    )
    started = rank0_engine(config)
    if started is None:
        return  # a worker rank, done
    ctx, engine, channel = started
    runner = engine.runner
    device = runner.device
    ttft_ms(engine, device, 16)  # warm-up
    step_ms, mean_context = batch1_decode(
        engine, device, args.context, args.steps, args.profile_steps
    )
    kv_bytes_per_token = runner.block_bytes() // runner.cfg.block_size
    figures = {
        "tp": ctx.world_size,
        "all_reduce": "nccl" if runner.tp.one_shot is None else runner.tp.one_shot.mode,
        "batch1_decode_ms": round(step_ms, 3),
        # the batch-1 step without the coordinator's host work (plan_replay_ms)
        "batch1_plan_and_wait_ms": round(
            plan_replay_ms(engine, device, args.context, args.steps, True), 3
        ),
        "batch1_gpu_ms": round(plan_replay_ms(engine, device, args.context, args.steps, False), 3),
        "ttft_prompt_tokens": min(1024, args.max_model_len // 2),
        "ttft_ms": round(ttft_ms(engine, device, min(1024, args.max_model_len // 2)), 2),
        "throughput_tokens_per_s": round(
            throughput(engine, device, args.num_seqs, args.max_len), 1
        ),
        "kv_gib_per_rank": round(runner.num_blocks * runner.block_bytes() / 2**30, 2),
        "weight_bytes_per_rank": sum(
            t.numel() * t.element_size() for t in runner.model.parameters()
        ),
        # what one batch-1 step reads on a rank: weights (not the embedding table, of which
        # a step reads one row) and the KV cache at the timed steps' mean context
        "batch1_mean_context": mean_context,
        "batch1_read_bytes_per_rank": ModelCost.of(runner).weight_bytes
        + round(mean_context * kv_bytes_per_token),
    }
    Path(args.json).write_text(json.dumps(figures))
    stop_group(channel)


if __name__ == "__main__":
    main()
