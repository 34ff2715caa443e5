"""Where a synchronous batch-1 decode step's time goes between the ranks at TP > 1.

Rank 0 sends one plan a step and waits for the step's greedy id on the host (as
bench/tp_worker.py's plan_replay_ms with wait); every rank notes host timestamps
(time.perf_counter_ns, one clock for all processes on a host) around the plan's send or
receive, the graph replay call and the wait. Prints the median of each interval in µs,
relative to rank 0's send; `--profile DIR` also writes torch.profiler Chrome traces (their
per-op overhead stretches the host side).

    torchrun --standalone --nproc-per-node=2 bench/tp_trace.py --model-config CFG
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch.distributed as dist

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.bench.offline import config_dir  # noqa: E402
from tapserve.bench.tp_worker import batch1_plan  # noqa: E402
from tapserve.coordinator.config import EngineConfig  # noqa: E402
from tapserve.coordinator.startup import start_rank, stop_group  # noqa: E402
from tapserve.ranks.group import shutdown_distributed  # noqa: E402
from tapserve.ranks.plan import StepKind  # noqa: E402

ns = time.perf_counter_ns


def timing_replays(runner, marks: dict) -> None:
    """Note when each graph replay call starts and returns (runner.graphs.replay wrapped);
    without graphs (the CPU, --enforce-eager) there is nothing to note."""
    if runner.graphs is None:
        del marks["replay_start"], marks["replay_end"]
        return
    replay = runner.graphs.replay

    def timed(plan, input_ids=None):
        marks["replay_start"].append(ns())
        out = replay(plan, input_ids)
        marks["replay_end"].append(ns())
        return out

    runner.graphs.replay = timed


def driver_steps(runner, channel, context: int, steps: int, marks: dict) -> None:
    plan = batch1_plan(runner, context)
    for _ in range(steps):
        marks["send_start"].append(ns())
        channel.send(plan)
        marks["send_end"].append(ns())
        ids = runner.execute(plan).logits.argmax(-1)
        marks["execute_end"].append(ns())
        ids.tolist()
        marks["ids_home"].append(ns())


def worker_steps(runner, channel, marks: dict) -> None:
    while True:
        plan = channel.recv()
        received = ns()
        if plan.kind is StepKind.STOP:
            return
        marks["recv_end"].append(received)
        runner.execute(plan)
        marks["execute_end"].append(ns())


def report(marks: list[dict], skip: int) -> dict:
    """Median µs of each mark after rank 0's send_start of the same step (the last len(send)
    steps of rank 1, whose first plans were warm-up ones it also ran)."""
    zero = marks[0]["send_start"][skip:]
    out = {}
    for rank, m in enumerate(marks):
        for name, ts in m.items():
            ts = ts[-len(zero) :] if rank else ts[skip:]
            out[f"rank{rank}.{name}"] = round(
                statistics.median((t - z) / 1e3 for t, z in zip(ts, zero)), 1
            )
    steps = [(b - a) / 1e3 for a, b in zip(zero, zero[1:])]
    out["step"] = round(statistics.median(steps), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", required=True)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--profile", help="also write torch.profiler traces here")
    args = p.parse_args()
    limit = json.loads(Path(args.model_config).read_text()).get("max_position_embeddings", 4096)
    config = EngineConfig(
        model=config_dir(args.model_config),
        load_format="dummy",
        max_model_len=min(4096, limit),
        enable_prefix_caching=False,
        max_num_seqs=16,
    )
    ctx, runner, channel = start_rank(config)
    marks = {
        k: []
        for k in (
            ("send_start", "send_end", "replay_start", "replay_end", "execute_end", "ids_home")
            if ctx.is_driver
            else ("recv_end", "replay_start", "replay_end", "execute_end")
        )
    }
    timing_replays(runner, marks)
    profiling = contextlib.nullcontext()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        profiling = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    with profiling as prof:
        if ctx.is_driver:
            driver_steps(runner, channel, args.context, args.warmup + args.steps, marks)
            stop_group(channel)
        else:
            worker_steps(runner, channel, marks)
    if prof is not None:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(args.profile) / f"rank{ctx.rank}.json"))
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, marks, group=ctx.plan_group)
    if ctx.is_driver:
        print(json.dumps(report(everyone, args.warmup), indent=1))
    shutdown_distributed()


if __name__ == "__main__":
    main()
