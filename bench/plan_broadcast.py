"""Plan build + broadcast per decode step at batch 256 (context 2K, block size 16) over gloo with
2 ranks, side by side with one bare gloo broadcast of the same number of bytes.
Goal: at most 1.5x the bare broadcast.

    python bench/plan_broadcast.py [--batch 256] [--context 2048] [--steps 200] [--rounds 5]
                                   [--int32-tables] [--cpus-per-rank K]

Block tables travel in the dtype the engine picks for the bench's pool (uint16 up to 65,536
blocks: ranks.plan.block_table_dtype); --int32-tables sends them as int32 for comparison.
--cpus-per-rank K pins rank r (and the gloo threads it starts) to cores [r*K, (r+1)*K)
(docs/benchmarks.md, 2026-12-06: two cores a rank helped on average, one core a rank that
polls for plans is far worse).

The batch is the engine's: the real Scheduler and BlockManager schedule it (prompts of
context - i % 16 tokens, so that one sequence in 16 takes a new block at each step), and
between plans every sequence advances by a token as Engine._postprocess leaves it. The
planner is the engine's (its block-table buffer persists across the steps of a round).
Scheduling and the advance are the engine's other work, not the plan's: they are left out of
the timing. Note that the scheduler's pass also records each row's newest token and table
stamp for the planner (reads the planner used to make itself): their cost is in
bench/step_overhead.py's "schedule", not here. The bare broadcast has the size of the plan
halfway through a round. Bare and plan rounds alternate; after one warm-up round of each kind
(counted nowhere) the best round of each is reported (shared machines are noisy), with the
best round's phases in microseconds per step: rank 0's build and send (encode and
broadcast); rank 1's recv (waiting for rank 0, the broadcast and the decode) and, of it, the
decode. Rank 1 decodes while rank 0 schedules the next step (as in the engine, where it
decodes while rank 0 prepares its forward), so its decode only counts when it is the slower
side.

Plans travel on a gloo group of their own through one PlanChannel for the whole run, as in
the engine. A round's first step is not timed, in any kind of round: in a plan round it is a
fresh planner's first, general build (the round starts from a new batch and a new planner),
which grows the planner's buffers and fills every row's table; its build and send are printed
as `first_step_us` (the slowest over the rounds). In the engine the planner lives for the
whole run: its buffers have grown by then, and a general build comes when the batch changes
(it rewrites the tables of the rows that are new).

A third kind of round, "paced", sends the bare bytes with the engine's work between
broadcasts (scheduling and the advance, untimed, as in the plan rounds), so that both sides
idle as long between broadcasts as in a plan round: `ratio_to_paced` compares with it. The
median per-step build and send of the best plan round are printed too (a plan whose longest
table outgrows its padding is widened in place, once in a while), with the quantiles of its
sends, the median step of the best bare round and `median_ratio`, the median plan step
(build + send) over the median bare broadcast: what a typical step costs, without the
occasional slow step that the means carry.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.api.sampling_params import SamplingParams  # noqa: E402
from tapserve.coordinator.blocks import BlockManager  # noqa: E402
from tapserve.coordinator.config import PLAN_POLL_SECONDS  # noqa: E402
from tapserve.coordinator.planner import Planner  # noqa: E402
from tapserve.coordinator.scheduled_batch import ScheduledBatch
from tapserve.coordinator.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from tapserve.coordinator.sequence import Request, SequenceFactory  # noqa: E402
from tapserve.ranks.group import PlanChannel  # noqa: E402
from tapserve.ranks.plan import block_table_dtype, encode_plan  # noqa: E402

BLOCK_SIZE = 16


class DecodingBatch:
    """batch sequences decoding at about `context` tokens through the engine's scheduler, each
    with a prompt of its own (no prefix-cache sharing)."""

    def __init__(self, batch: int, context: int, steps: int):
        blocks = batch * (-(-(context + steps) // BLOCK_SIZE) + 1)
        self.table_dtype = block_table_dtype(blocks)  # as the engine picks it for its pool
        self.scheduler = Scheduler(
            SchedulerConfig(batch, 1 << 30), BlockManager(blocks, BLOCK_SIZE)
        )
        factory = SequenceFactory()
        for i in range(batch):
            prompt = [(7919 * i + j) % 50000 for j in range(context - i % BLOCK_SIZE)]
            request = Request(str(i), prompt, SamplingParams(max_new_tokens=steps + 8), i)
            request.single = True  # n = 1, no beams, no stop strings (as Engine.add_request sets)
            factory.prompt_sequence(request)
            self.scheduler.add(request)
        self.advance(self.scheduler.schedule())  # the prefill step

    def advance(self, batch: ScheduledBatch) -> None:
        """What Engine._postprocess does to a decoding batch: the KV is computed, full blocks
        go to the prefix cache, a token is appended, and the scheduler hears that every row
        gained its token alone (Scheduler.note_advanced: the next step is a steady one)."""
        blocks = self.scheduler.blocks
        tokens = []
        for seq, context_len in zip(batch.seqs, batch.context_lens):
            filled = context_len // BLOCK_SIZE != seq.num_computed_tokens // BLOCK_SIZE
            seq.num_computed_tokens = context_len
            if filled:
                blocks.register_computed(seq)
            tokens.append(context_len % 50000)
            seq.token_ids.append(tokens[-1])
        if batch.num_new_tokens.count(1) == len(batch.seqs):
            self.scheduler.note_advanced(batch, tokens)


def worker(rank: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    if args.cpus_per_rank:  # before the group starts: gloo's threads inherit the mask
        first = rank * args.cpus_per_rank
        os.sched_setaffinity(0, range(first, first + args.cpus_per_rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    # plans on a gloo group of their own, one channel for the whole run, as in the engine
    spin_ms = (
        args.spin_ms
        if args.spin_ms is not None
        else (PLAN_POLL_SECONDS * 1e3 if torch.cuda.is_available() else 0.0)
    )  # as the engine's ranks
    channel = PlanChannel(dist.new_group(backend="gloo"), spin_s=spin_ms / 1e3 if rank else 0.0)
    if args.no_decode and rank == 1:
        from tapserve.ranks import group as group_module

        group_module.decode_plan = lambda payload, **kw: None  # the bytes arrive; nothing read
        group_module.PlanDecoder.decode = lambda self, payload: None
    decode_seconds = _time_plan_decoding() if rank == 1 else [0.0]
    # the bare broadcast's size: the plan halfway through a round (tables grow as it decodes)
    sizes = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        probe = DecodingBatch(args.batch, args.context + args.steps // 2, args.steps)
        probe_planner = _planner(args, probe)
        sizes[0] = len(encode_plan(probe_planner.build(probe.scheduler.schedule())[0]))
    dist.broadcast(sizes, src=0)
    nbytes = int(sizes[0])
    bare = torch.zeros(nbytes, dtype=torch.uint8)
    timings: dict[str, float] = {}
    phases = {"build": [], "send": [], "recv": [], "decode": []}  # per plan round: us per step
    per_step = {"build": [], "send": []}  # rank 0's best plan round, seconds per step
    bare_steps: list[float] = []  # rank 0's best bare round, seconds per step
    first_steps: list[tuple[float, float]] = []  # each plan round's first build and send
    for r, name in enumerate(("bare", "paced", "plan") * (args.rounds + 1)):
        warm_up = r < 3  # the first round of each kind counts nowhere
        if name != "bare" and rank == 0:  # each round decodes from the same start
            decoding = DecodingBatch(args.batch, args.context, args.steps)
            # the round's block manager stamps tables anew
            planner = _planner(args, decoding)
        steps: dict[str, list[float]] = {"build": [], "send": [], "broadcast": []}
        spent = {"build": 0.0, "send": 0.0, "recv": 0.0, "engine": 0.0}
        dist.barrier()
        for step in range(args.steps + 1):
            if step == 1:  # a round's first step is not timed (see the docstring)
                if name == "plan" and rank == 0 and not warm_up:
                    first_steps.append((steps["build"][0], steps["send"][0]))
                start = time.perf_counter()
                spent = {"build": 0.0, "send": 0.0, "recv": 0.0, "engine": 0.0}
                steps = {"build": [], "send": [], "broadcast": []}
                decode_seconds[0] = 0.0
            if name == "bare" or (name == "paced" and rank == 1):
                t0 = time.perf_counter()
                dist.broadcast(bare, src=0)
                steps["broadcast"].append(time.perf_counter() - t0)
            elif name == "paced":  # the engine's work between steps, then the bare bytes
                t0 = time.perf_counter()
                decoding.advance(decoding.scheduler.schedule())
                t1 = time.perf_counter()
                dist.broadcast(bare, src=0)
                spent["engine"] += t1 - t0
            elif rank == 0:
                t0 = time.perf_counter()
                batch = decoding.scheduler.schedule()
                t1 = time.perf_counter()
                plan = planner.build(batch)[0]
                t2 = time.perf_counter()
                if args.encode:  # sent the general way: encoded into the channel's buffer
                    plan = dataclasses.replace(plan, wire=None)
                channel.send(plan)
                t3 = time.perf_counter()
                decoding.advance(batch)
                spent["build"] += t2 - t1
                spent["send"] += t3 - t2
                steps["build"].append(t2 - t1)
                steps["send"].append(t3 - t2)
                spent["engine"] += time.perf_counter() - t3 + t1 - t0
            else:
                t0 = time.perf_counter()
                channel.recv()
                spent["recv"] += time.perf_counter() - t0
        dist.barrier()
        # the engine's other work between plans (scheduling, the advance) is not the plan's cost
        elapsed = (time.perf_counter() - start - spent["engine"]) / args.steps * 1e3
        if warm_up:
            continue
        if name == "plan" and rank == 0 and elapsed < timings.get("plan", float("inf")):
            per_step = steps
        if name == "bare" and rank == 0 and elapsed < timings.get("bare", float("inf")):
            bare_steps = steps["broadcast"]
        timings[name] = min(timings.get(name, float("inf")), elapsed)
        if name == "plan":
            spent["decode"] = decode_seconds[0]
            for key in ("build", "send") if rank == 0 else ("recv", "decode"):
                phases[key].append(spent[key] / args.steps * 1e6)
    results[f"phases_rank{rank}"] = {k: round(min(v), 1) for k, v in phases.items() if v}
    if rank == 0:
        results.update(
            {
                "batch": args.batch,
                "context": args.context,
                "plan_bytes": nbytes,
                "bare_broadcast_ms": round(timings["bare"], 3),
                "paced_bare_broadcast_ms": round(timings["paced"], 3),
                "plan_build_and_broadcast_ms": round(timings["plan"], 3),
                "ratio": round(timings["plan"] / timings["bare"], 2),
                "ratio_to_paced": round(timings["plan"] / timings["paced"], 2),
                "median_step_us": {
                    k: round(statistics.median(v) * 1e6, 1) for k, v in per_step.items() if v
                },
                "median_bare_us": round(statistics.median(bare_steps) * 1e6, 1),
                "median_ratio": round(
                    _median_plan_step(per_step) / statistics.median(bare_steps), 2
                ),
                "send_us_quantiles": _quantiles(per_step["send"]),
                "first_step_us": [round(max(t) * 1e6) for t in zip(*first_steps)],
            }
        )
    dist.destroy_process_group()


def _planner(args, decoding: DecodingBatch) -> Planner:
    dtype = np.dtype(np.int32) if args.int32_tables else decoding.table_dtype
    return Planner(BLOCK_SIZE, width_step=args.width_step, table_dtype=dtype)


def _median_plan_step(per_step: dict[str, list[float]]) -> float:
    """The median over a round's steps of build + send."""
    return statistics.median(b + s for b, s in zip(per_step["build"], per_step["send"]))


def _quantiles(seconds: list[float]) -> dict[str, float]:
    """p10, p50, p90, p99 and max of one round's per-step times, in microseconds."""
    q = statistics.quantiles(seconds, n=100, method="inclusive")
    return {
        "p10": round(q[9] * 1e6, 1),
        "p50": round(q[49] * 1e6, 1),
        "p90": round(q[89] * 1e6, 1),
        "p99": round(q[98] * 1e6, 1),
        "max": round(max(seconds) * 1e6, 1),
    }


def _time_plan_decoding() -> list[float]:
    """Make PlanChannel.recv's decodes (PlanDecoder's, and decode_plan for a plan sent in two
    broadcasts) add their seconds to the returned one-item list."""
    from tapserve.ranks import group as group_module

    seconds = [0.0]

    def timed(decode):
        def run(*args, **kwargs):
            start = time.perf_counter()
            plan = decode(*args, **kwargs)
            seconds[0] += time.perf_counter() - start
            return plan

        return run

    group_module.decode_plan = timed(group_module.decode_plan)
    group_module.PlanDecoder.decode = timed(group_module.PlanDecoder.decode)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--width-step",
        type=int,
        default=16,
        help="the planner's block-table padding (columns; 1 = none)",
    )
    p.add_argument(
        "--encode",
        action="store_true",
        help="send each plan encoded, not from its laid-out message (for comparison)",
    )
    p.add_argument(
        "--no-decode",
        action="store_true",
        help="rank 1 receives the bytes but does not decode them (for comparison)",
    )
    p.add_argument(
        "--spin-ms",
        type=float,
        default=None,
        help="rank 1 polls for each plan this long before it blocks (default: as "
        "the engine, 5 on a machine with CUDA, else 0)",
    )
    p.add_argument(
        "--int32-tables",
        action="store_true",
        help="block tables in int32 even where uint16 holds the pool (for comparison)",
    )
    p.add_argument(
        "--cpus-per-rank",
        type=int,
        default=0,
        help="pin rank r (and the gloo threads it starts) to cores "
        "[r*K, (r+1)*K) (default 0: no pinning)",
    )
    args = p.parse_args()
    if args.cpus_per_rank * 2 > len(os.sched_getaffinity(0)):
        p.error("--cpus-per-rank: not enough cores for two ranks")
    if args.steps < 2 or args.rounds < 1:
        p.error("--steps must be at least 2 (quantiles) and --rounds at least 1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(port, args, results), nprocs=2)
        out = dict(results)
        # best round of each phase, us per step: rank 0's build and send (encode + broadcast),
        # rank 1's receive (broadcast + decode)
        out["phases_us"] = {**out.pop("phases_rank0"), **out.pop("phases_rank1")}
        print(json.dumps(out))


if __name__ == "__main__":
    main()
