"""Decode step time vs batch size at a fixed context, with bandwidth efficiency:
(weight bytes + KV bytes read per step) / (step time x B), and each step's floor
max(bytes / B, FLOPs / F), B (a device-to-device copy) and F (a bf16 GEMM) measured at the
start of the same run (bench/roofline.py) and recorded in the JSON with the GPU's name.

    python bench/decode_sweep.py --model-config ../shared/reference/configs/qwen3-8b.json \
        --batch-sizes 1,2,4,8,16,32,64,128,256 --context 1024 [--json out.json] [--profile-steps 16]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.api.sampling_params import SamplingParams  # noqa: E402
from tapserve.bench import roofline  # noqa: E402
from tapserve.bench.offline import config_dir, print_step_profile  # noqa: E402
from tapserve.bench.step_cost import ModelCost  # noqa: E402
from tapserve.coordinator.config import EngineConfig  # noqa: E402
from tapserve.coordinator.offline import LLM  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_decode(
    llm: LLM, batch: int, context: int, steps: int, profile_steps: int = 0
) -> tuple[float, float]:
    """Mean decode step time with `batch` sequences running throughout, and their mean
    context length over the timed steps (early-admitted sequences decode while later prompts
    prefill, so they are longer than `context`)."""
    engine = llm.engine
    room = engine.options.max_model_len - context
    params = SamplingParams(max_new_tokens=room, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"b{batch}-{i}", [(7 * i + j) % 1000 + 1 for j in range(context)], params
        )
    while (
        any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    lengths = [len(s.token_ids) for s in engine.scheduler.running]
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    elapsed = (time.perf_counter() - start) / steps
    if len(engine.scheduler.running) != batch or len(lengths) != batch:
        raise RuntimeError(f"only {len(engine.scheduler.running)} of {batch} sequences running")
    replay_graph(llm, batch, steps)
    if profile_steps:
        print_step_profile(engine, profile_steps)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.step()
    return elapsed, sum(lengths) / batch + steps / 2


def replay_graph(llm: LLM, batch: int, replays: int) -> None:
    """The batch's decode graph replayed back to back with no host work between: the GPU's
    time for the model's forward alone (the step adds the LM head, sampling and the host's
    turn between steps). The replays rewrite the last step's KV slots with the same values."""
    graphs = llm.runner.graphs
    if graphs is None:
        return
    graph = graphs.graphs[graphs.buckets[graphs.bucket_for(batch)]]
    graph.replay()
    sync()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    sync()
    print(
        json.dumps(
            {
                "batch": batch,
                "graph_replay_ms": round((time.perf_counter() - start) / replays * 1e3, 3),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-config", required=True)
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--json")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after timing each batch, profile this many steps (GPU kernel time vs wall)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="the engine's context limit (it sets the decode KV split count); "
        "raised to what the run needs if smaller; default: just that",
    )
    p.add_argument(
        "--async-scheduling",
        default="on",
        help="on, off, or on,off: each batch timed in each mode in turn (coordinator/run_ahead.py)",
    )
    roofline.add_arguments(p)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    machine = roofline.measure(device, args.copy_bytes, args.gemm_size)
    bandwidth, flops_per_s = machine["copy_bytes_per_s"], machine["bf16_flops_per_s"]
    print(roofline.describe(machine), flush=True)
    modes = [{"on": True, "off": False}[m] for m in args.async_scheduling.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    budget = 8192  # max_num_batched_tokens: the largest batch prefills in this many steps
    prefill_steps = -(-max(batches) * args.context // budget)
    run_len = args.context + prefill_steps + args.steps + args.profile_steps + 64
    llm = LLM(
        EngineConfig(
            model=config_dir(args.model_config),
            load_format="dummy",
            max_num_seqs=max(batches),
            max_num_batched_tokens=budget,
            max_model_len=max(run_len, args.max_model_len or 0),
            enforce_eager=args.enforce_eager,
            enable_prefix_caching=False,
        )
    )
    cost = ModelCost.of(llm.runner)
    wbytes, kv_per_token = cost.weight_bytes, cost.kv_bytes_per_token
    rows = []
    for b in batches:
        need = b * -(-run_len // llm.runner.cfg.block_size)
        if need > llm.runner.num_blocks:
            print(f"batch {b}: KV does not fit ({need} > {llm.runner.num_blocks} blocks)")
            break
        for run_ahead in modes:
            llm.engine.run_ahead = run_ahead  # between batches: no step is in flight
            try:
                t, mean_context = time_decode(llm, b, args.context, args.steps, args.profile_steps)
            except RuntimeError as e:
                print(f"batch {b}: {e}")
                break
            read = wbytes + b * mean_context * kv_per_token
            floor = roofline.step_floor(
                read, cost.decode_flops(b, mean_context), bandwidth, flops_per_s
            )
            rows.append(
                {
                    "batch": b,
                    "context": args.context,
                    "mean_context": round(mean_context),
                    "async_scheduling": run_ahead,
                    "step_ms": round(t * 1e3, 3),
                    "tokens_per_s": round(b / t, 1),
                    "floor_ms": round(floor * 1e3, 4),
                    "ratio_to_floor": round(t / floor, 3),
                    "bandwidth_efficiency": round(read / (t * bandwidth), 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        else:
            continue
        break  # a batch that failed: larger ones would too (as before the modes loop)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"weight_bytes": wbytes, "machine": machine, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
