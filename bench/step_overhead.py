"""The coordinator's per-step CPU work (schedule, build plan, post-process incl. sampling) at
256 running decode sequences, with the model replaced by a stand-in that returns fixed logits.
Goal: under 1 ms per decode step.

    python bench/step_overhead.py [--seqs 256] [--context 2048] [--vocab 151936] [--rounds 5]
        [--temperature 0.6] [--device cuda|cpu]

The stand-in's logits live where a model's would: on the GPU when there is one (the default
device), so the draw runs there as in serving. On a CPU-only machine a 151,936-wide vocabulary
makes the draw itself (an argmax over 39M floats) most of the step; `--vocab 1024` measures
the bookkeeping alone.

Prints the best and the median round (--steps decode steps each): shared machines are noisy,
and the best round is the code's cost with the least interference. `--phases` also prints the
mean µs per step of each phase of Engine.step over the rounds after the first (a timer around
each, ~1 µs added per phase; "sample" and "append" are parts of "postprocess").
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.api.sampling_params import SamplingParams  # noqa: E402
from tapserve.bench.last_token_head import PairLinearHead  # noqa: E402
from tapserve.coordinator.config import EngineOptions  # noqa: E402
from tapserve.coordinator.engine import Engine  # noqa: E402
from tapserve.coordinator.scheduler import SchedulerConfig  # noqa: E402
from tapserve.model.layers import TPGroup  # noqa: E402
from tapserve.ranks.plan import StepPlan  # noqa: E402
from tapserve.ranks.runner import StepOutput  # noqa: E402


@dataclass
class _Cfg:
    block_size: int = 16


class StandInRunner:
    """Looks like ModelRunner to the engine; 'runs' a step by returning preset logits."""

    tp = TPGroup()  # one rank

    def __init__(self, num_blocks: int, vocab: int, max_seqs: int, device: str):
        self.num_blocks, self.cfg, self.device = num_blocks, _Cfg(), torch.device(device)
        self.logits = torch.randn(max_seqs, vocab, device=device)
        self.hidden = torch.randn(max_seqs * 4, 8, device=device)

    def graph_bucket_for(self, plan: StepPlan) -> int:
        return -1

    def execute(self, plan: StepPlan, input_ids: torch.Tensor | None = None) -> StepOutput:
        hidden = self.hidden[: plan.num_tokens]
        return StepOutput(hidden, self.logits[: plan.logit_rows.shape[0]])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--steps", type=int, default=100, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="decode steps run ahead (the default on GPUs)",
    )
    p.add_argument(
        "--custom-params",
        help="custom_output_params of every request as JSON, e.g. '{\"position\": [-3]}', for "
        "a linear head (hidden -> 2) on the stand-in's hidden states",
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument("--phases", action="store_true", help="time each phase of Engine.step")
    args = p.parse_args()
    torch.set_num_threads(1)
    total = args.steps * args.rounds
    blocks_per_seq = -(-(args.context + total + 8) // 16)
    runner = StandInRunner(args.seqs * blocks_per_seq + 1, args.vocab, args.seqs, args.device)
    engine = Engine(
        runner,
        EngineOptions(
            max_model_len=args.context + total + 64,
            eos_token_ids=[],
            vocab_size=args.vocab,
            scheduler=SchedulerConfig(args.seqs, 1 << 30),
            # without run-ahead: the host's whole turn, step by step (no overlap)
            async_scheduling=args.async_scheduling,
        ),
        handler=PairLinearHead() if args.custom_params else None,
    )
    custom = json.loads(args.custom_params) if args.custom_params else None
    params = SamplingParams(max_new_tokens=total + 8, temperature=args.temperature, ignore_eos=True)
    for i in range(args.seqs):
        prompt = [(i + j) % 1000 for j in range(args.context)]
        engine.add_request(str(i), prompt, params, custom_output_params=custom)
    engine.step()  # the prefill step
    engine.step()
    phases = time_phases(engine) if args.phases else {}
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    rounds = []
    timed_steps = 0  # steps whose phases are in `phases`
    for r in range(args.rounds):
        if r == 1:
            phases.clear()  # the first round may compile kernels (the sampling kernel's variants)
            timed_steps = 0
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        rounds.append((time.perf_counter() - start) / args.steps)
        timed_steps += args.steps
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    figures = {
        "seqs": args.seqs,
        "context": args.context,
        "vocab": args.vocab,
        "temperature": args.temperature,
        "async_scheduling": args.async_scheduling,
        "custom_params": custom,
        "device": args.device,
        "coordinator_ms_per_decode_step": round(min(rounds) * 1e3, 3),
        "median_round_ms": round(statistics.median(rounds) * 1e3, 3),
    }
    if phases:
        figures["phases_us_per_step"] = {
            k: round(v * 1e6 / timed_steps, 1) for k, v in phases.items()
        }
    print(json.dumps(figures))


def time_phases(engine: Engine) -> dict[str, float]:
    """Wrap the engine's step phases in timers; returns the dict they add seconds to."""
    spent: dict[str, float] = {}
    targets = {
        "schedule": (engine.scheduler, "schedule"),
        "build": (engine.planner, "build"),
        "execute": (engine.runner, "execute"),
        "postprocess": (engine, "_postprocess"),
        "sample": (engine.tokens, "sample"),
        "append": (engine.tokens, "append_plain"),
        "outputs": (engine, "_collect_outputs"),
    }
    for name, (owner, attr) in targets.items():
        setattr(owner, attr, _timed(getattr(owner, attr), name, spent))
    return spent


def _timed(fn, name: str, spent: dict[str, float]):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start

    return timed


if __name__ == "__main__":
    main()
