"""Offline throughput on the nano-vllm workload (DESIGN.md "Reference workloads"):
256 sequences, random.seed(0), prompt ids uniform in [0, 10000], input and output lengths
uniform in [100, 1024], ignore_eos, temperature 0.6. Prints output tokens / wall time
(prefill included) and, on a GPU, the ratio to the workload's roofline floor: the sum of its
steps' floors max(bytes / B, FLOPs / F) (bench/step_cost.py), B and F measured first in the
same run (bench/roofline.py).

    python bench/offline.py --model-config ../shared/reference/configs/qwen3-0.6b.json
    python bench/offline.py --model DIR [--custom-module examples/reward_head.py]

The custom head's cost: `--ab-rounds N` with a `--custom-module` whose selector honours
{"position": -1} (e.g. bench/last_token_head.py:LastTokenLinearHead) runs the workload 2N
times in one engine, alternating head on / head off (prefix caching off, so every round
computes every prompt), and reports both the best and the median round of each, with each
round's engine_steps_ahead / engine_steps. `--ab-params '{"position": [-3]}'` turns the head
on for every generated token (with bench/last_token_head.py:PairLinearHead, [hidden -> 2]).

`--step-kinds` also reports, per plan kind (prefill, mixed, decode), the number of steps, the
wall seconds of the engine steps that ran them and the sum of their floors (a step's wall time
is its GPU time plus the host work not hidden behind it; under asynchronous scheduling a step
call waits for the step before, so the split between kinds is approximate).

`--profile-steps N` instead runs the workload's first N steps twice (the first time to
compile, then aborted) and prints torch.profiler's GPU kernel time of the second, per kernel:
the prefill and mixed steps, where the prompts are computed. Profile with TAPSERVE_PDL=0
(under programmatic dependent launch a kernel's wait for its predecessor counts as its time).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

import torch  # noqa: E402

from tapserve.api.gc_policy import settle_after_startup  # noqa: E402
from tapserve.api.sampling_params import SamplingParams  # noqa: E402
from tapserve.bench import roofline  # noqa: E402
from tapserve.bench.step_cost import ModelCost  # noqa: E402
from tapserve.coordinator.config import EngineConfig  # noqa: E402
from tapserve.coordinator.engine import Engine  # noqa: E402
from tapserve.coordinator.offline import LLM  # noqa: E402


def workload(num_seqs: int, max_input: int, max_output: int, seed: int = 0):
    random.seed(seed)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, max_input))]
        for _ in range(num_seqs)
    ]
    params = [
        SamplingParams(
            temperature=0.6, ignore_eos=True, max_new_tokens=random.randint(100, max_output)
        )
        for _ in range(num_seqs)
    ]
    return prompts, params


def config_dir(config_json: str) -> str:
    """A checkpoint folder holding only config.json (for --load-format dummy)."""
    folder = tempfile.mkdtemp(prefix="tapserve-bench-")
    shutil.copy(config_json, Path(folder) / "config.json")
    return folder


def head_ab(llm: LLM, prompts, params, args) -> None:
    """Alternate head on / off (on, off, off, on, ...: drift hits both alike). The "on" arm's
    custom_output_params are --ab-params (default: the head's own selection)."""
    rounds: dict[str, list[float]] = {"on": [], "off": []}
    steps: dict[str, list[list[int]]] = {"on": [], "off": []}
    on = json.loads(args.ab_params) if args.ab_params else None
    engine = llm.engine
    for r in range(2 * args.ab_rounds):
        mode = "on" if r % 4 in (0, 3) else "off"
        custom = [on if mode == "on" else {"position": -1}] * len(prompts)
        calls, ahead, total = engine.custom_stats.calls, engine.num_ahead_steps, engine.num_steps
        start = time.perf_counter()
        llm.generate(prompts, params, custom_output_params=custom)
        rounds[mode].append(round(time.perf_counter() - start, 3))
        steps[mode].append([engine.num_ahead_steps - ahead, engine.num_steps - total])
        print(
            json.dumps(
                {
                    "round": r,
                    "head": mode,
                    "seconds": rounds[mode][-1],
                    "handler_calls": engine.custom_stats.calls - calls,
                    "engine_steps_ahead/engine_steps": steps[mode][-1],
                }
            ),
            flush=True,
        )
    best = {m: min(v) for m, v in rounds.items()}
    median = {m: statistics.median(v) for m, v in rounds.items()}
    out_tokens = sum(p.max_new_tokens for p in params)  # ignore_eos: each runs to its length
    figures = {
        "custom_module": args.custom_module,
        "ab_params": on,
        "rounds": rounds,
        "engine_steps_ahead/engine_steps": steps,
        "output_tokens_per_s_median": {
            m: round(out_tokens / statistics.median(v), 1) for m, v in rounds.items()
        },
        "best_on_s": best["on"],
        "best_off_s": best["off"],
        "cost_best": round(best["on"] / best["off"] - 1, 4),
        "cost_median": round(median["on"] / median["off"] - 1, 4),
    }
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


def print_step_profile(engine: Engine, steps: int, top: int = 12) -> None:
    """torch.profiler over the engine's next `steps` steps: wall time against the GPU's kernel
    time per step (the difference is the GPU idling: host work between kernels and steps),
    and the kernels that take the most time, per step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    kernels = [
        e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"
    ]
    gpu = sum(e.device_time_total for e in kernels) / steps / 1e3
    print(
        json.dumps(
            {
                "profiled_steps": steps,
                "wall_ms_per_step": round(wall * 1e3, 3),
                "gpu_kernel_ms_per_step": round(gpu, 3),
            }
        )
    )
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:top]:
        print(
            f"  {e.device_time_total / steps / 1e3:8.3f} ms/step {e.count // steps:5d}x  {e.key[:90]}"
        )


def profile_first_steps(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], steps: int
) -> None:
    """The workload's first `steps` steps, once to compile (then aborted), once profiled."""
    engine = llm.engine
    for attempt in ("warm", "profiled"):
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"{attempt}-{i}", prompt, p)
        if attempt == "profiled":
            print_step_profile(engine, steps, top=18)
        else:
            for _ in range(steps):
                engine.step()
        for rid in list(engine.requests):
            engine.abort_request(rid)
        engine.step()  # the aborts' outputs


class StepMeter:
    """Wraps an engine's planner.build and step: per plan kind (prefill, mixed, decode), the
    steps, the wall seconds of the engine steps that ran them and, given a cost model and the
    machine's B and F, the sum of their floors. reset() starts a new count."""

    def __init__(self, engine: Engine, cost: ModelCost, machine: dict | None) -> None:
        self.kinds: dict[str, list[float]] = {}
        self._kind: str | None = None
        build, step = engine.planner.build, engine.step

        def noting_build(batch):
            plan, rows = build(batch)
            self._kind = plan.kind.name.lower()
            if machine is not None:
                floor = cost.step_floor(
                    plan, machine["copy_bytes_per_s"], machine["bf16_flops_per_s"]
                )
                self._entry(self._kind)[2] += floor
            return plan, rows

        def timed_step():
            self._kind = None
            start = time.perf_counter()
            outputs = step()
            entry = self._entry(self._kind or "idle")
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            return outputs

        engine.planner.build, engine.step = noting_build, timed_step

    def _entry(self, kind: str) -> list[float]:
        return self.kinds.setdefault(kind, [0, 0.0, 0.0])

    def reset(self) -> None:
        self.kinds = {}

    @property
    def floor_seconds(self) -> float:
        return sum(floor for _, _, floor in self.kinds.values())

    def report(self) -> dict[str, dict]:
        return {
            kind: {"steps": n, "seconds": round(t, 3), "floor_seconds": round(floor, 4)}
            for kind, (n, t, floor) in self.kinds.items()
        }


def async_ab(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], rounds: int) -> None:
    """The workload with asynchronous scheduling on and off in turn, in one process (the same
    weights, graphs and GPU state): a line of JSON per run, then the best of each."""
    best: dict[bool, float] = {}
    for r in range(rounds):
        for run_ahead in (True, False):
            llm.engine.run_ahead = run_ahead  # between runs: no step is in flight
            start = time.perf_counter()
            llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            best[run_ahead] = min(best.get(run_ahead, elapsed), elapsed)
            print(
                json.dumps(
                    {"round": r, "async_scheduling": run_ahead, "seconds": round(elapsed, 3)}
                ),
                flush=True,
            )
    print(
        json.dumps(
            {
                "best_async": round(best[True], 3),
                "best_sync": round(best[False], 3),
                "speedup": round(best[False] / best[True], 4),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="checkpoint folder (weights loaded)")
    p.add_argument(
        "--model-config", help="config.json of a real model: random weights of its shapes"
    )
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--custom-module")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        help="measure B and F (bench/roofline.py) first and report the workload's floor, the "
        "sum of its steps' floors (default: on a GPU)",
    )
    roofline.add_arguments(p)
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument(
        "--step-kinds",
        action="store_true",
        help="steps and seconds per plan kind (prefill / mixed / decode)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile the workload's first N steps instead of timing it (GPU)",
    )
    p.add_argument(
        "--ab-rounds", type=int, default=0, help="head on / head off rounds (needs --custom-module)"
    )
    p.add_argument(
        "--ab-params",
        help='the "on" arm\'s custom_output_params as JSON, e.g. \'{"position": [-3]}\' '
        "(every generated token; default: the head's own selection)",
    )
    p.add_argument(
        "--async-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="asynchronous scheduling on / off rounds in one process",
    )
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time the workload this many times (prefix caching off) and report the median",
    )
    p.add_argument(
        "--custom-params",
        help="custom_output_params of every request as JSON (with --custom-module), e.g. "
        "'{\"position\": [-3]}'",
    )
    args = p.parse_args()
    if args.ab_rounds and not args.custom_module:
        p.error("--ab-rounds needs --custom-module")
    model = args.model or config_dir(args.model_config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.floor is None:
        args.floor = device == "cuda"
    machine = roofline.measure(device, args.copy_bytes, args.gemm_size) if args.floor else None
    if machine:
        print(roofline.describe(machine), flush=True)
    config = EngineConfig(
        model=model,
        load_format="safetensors" if args.model else "dummy",
        custom_module=args.custom_module,
        enforce_eager=args.enforce_eager,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        # the A/B rounds and the profile's second pass must recompute prompts
        enable_prefix_caching=not (
            args.ab_rounds or args.profile_steps or args.async_ab or args.rounds > 1
        ),
        async_scheduling=False if args.no_async_scheduling else None,
    )
    llm = LLM(config)
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))  # warm-up
    settle_after_startup()  # the garbage collector as in a serving rank (api/gc_policy.py)
    if args.ab_rounds:
        head_ab(llm, prompts, params, args)
        return
    if args.async_ab:
        async_ab(llm, prompts, params, args.async_ab)
        return
    if args.profile_steps:
        profile_first_steps(llm, prompts, params, args.profile_steps)
        return
    meter = None
    if args.step_kinds or machine:
        meter = StepMeter(llm.engine, ModelCost.of(llm.runner), machine)
    custom = json.loads(args.custom_params) if args.custom_params else None
    rounds = []
    for _ in range(args.rounds):
        if meter:
            meter.reset()
        start = time.perf_counter()
        per_request = custom and [custom] * len(prompts)
        results = llm.generate(prompts, params, custom_output_params=per_request)
        rounds.append(round(time.perf_counter() - start, 3))
    elapsed = statistics.median(rounds)
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    in_tokens = sum(len(x) for x in prompts)
    figures = {
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "seconds": round(elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "custom_module": args.custom_module,
        "custom_params": custom,
        "kv_blocks": llm.runner.num_blocks,
    }
    if args.rounds > 1:
        figures["round_seconds"] = rounds
    if machine and meter:
        figures["machine"] = machine
        figures["floor_seconds"] = round(meter.floor_seconds, 4)  # the last round's
        figures["ratio_to_floor"] = round(elapsed / meter.floor_seconds, 3)
    if args.step_kinds and meter:
        figures["step_kinds"] = meter.report()
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
