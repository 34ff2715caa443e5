"""Where a plan's send loses time against a bare broadcast of the same bytes (a diagnostic for
bench/plan_broadcast.py's ratio). Two ranks over gloo, batch 256 at context 2K, the engine's
scheduler and planner as in plan_broadcast.py; every kind of round sends on the plan group
and rank 0 does the engine's work between sends:

    paced          the bare bytes (a torch buffer of the plan message's size), no plan built
    plan           the engine's way: build, PlanChannel.send, rank 1 PlanChannel.recv + decode
    plan_nodecode  as plan, but rank 1 only receives the bytes (no decode)
    plan_copy      as plan_nodecode, with the built message copied into a torch buffer (the
                   copy counted in the build) and that buffer broadcast

Per kind (all rounds but the first, pooled): rank 0's send time (median, p90, mean) and
rank 1's lead, how long before rank 0's send rank 1 posted its receive (host clocks of one
machine), in microseconds.

    python bench/plan_send_probe.py [--rounds 4] [--steps 200] [--gc on|off]
"""

from __future__ import annotations

import argparse
import gc
import json
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.bench.plan_broadcast import DecodingBatch, _planner  # noqa: E402
from tapserve.ranks.group import HEADER_BYTES, PlanChannel  # noqa: E402

KINDS = ("paced", "plan", "plan_nodecode", "plan_copy")


def _rank0_step(
    kind: str, decoding: DecodingBatch, planner, channel: PlanChannel, copy: torch.Tensor
) -> tuple[float, float]:
    """One step on rank 0; returns (send start, send end)."""
    if kind == "paced":
        decoding.advance(decoding.scheduler.schedule())
        start = time.perf_counter()
        dist.broadcast(copy, src=0, group=channel.group)
        return start, time.perf_counter()
    batch = decoding.scheduler.schedule()
    plan = planner.build(batch)[0]
    if kind == "plan_copy":
        wire = plan.wire
        wire.seal(plan)
        body = slice(wire.start + HEADER_BYTES, wire.start + HEADER_BYTES + wire.nbytes)
        copy.numpy()[HEADER_BYTES : HEADER_BYTES + wire.nbytes] = wire.buffer[body]
        start = time.perf_counter()
        dist.broadcast(copy, src=0, group=channel.group)
    else:
        start = time.perf_counter()
        channel.send(plan)
    end = time.perf_counter()
    decoding.advance(batch)
    return start, end


def _rank1_step(kind: str, channel: PlanChannel, copy: torch.Tensor) -> float:
    """One step on rank 1; returns when it posted its receive."""
    posted = time.perf_counter()
    if kind in ("paced", "plan_copy"):
        dist.broadcast(copy, src=0, group=channel.group)
    elif kind == "plan":
        channel.recv()
    else:  # the bytes only, keeping the channel's agreed size (plan rounds came first and
        # sized it for the round's largest plan)
        message = channel._receive_buffer(channel.size)
        dist.broadcast(message, src=0, group=channel.group)
        n, channel.size = (int(v) for v in message.numpy()[:HEADER_BYTES].view("<u8"))
        assert n + HEADER_BYTES <= message.numel(), "a plan outgrew the agreed size"
    return posted


def worker(rank: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    if args.gc == "off":
        gc.disable()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    channel = PlanChannel(dist.new_group(backend="gloo"))
    size = torch.zeros(1, dtype=torch.int64)
    times: dict[str, list] = {kind: [] for kind in KINDS}
    for r in range(args.rounds + 1):
        for kind in KINDS:
            decoding = planner = None
            if rank == 0:
                decoding = DecodingBatch(args.batch, args.context, args.steps)
                planner = _planner(args, decoding)
                size[0] = channel.size
            dist.broadcast(size, src=0)  # the message size paced and plan_copy rounds send
            copy = torch.zeros(int(size[0]), dtype=torch.uint8)
            dist.barrier()
            for step in range(args.steps + 1):
                t = (
                    _rank0_step(kind, decoding, planner, channel, copy)
                    if rank == 0
                    else _rank1_step(kind, channel, copy)
                )
                if r and step:  # the first round and each round's first step are warm-up
                    times[kind].append(t)
            dist.barrier()
    results[rank] = times
    dist.destroy_process_group()


def _summary(sends: list[tuple[float, float]], posts: list[float]) -> dict:
    us = [(end - start) * 1e6 for start, end in sends]
    lead = [(start - posted) * 1e6 for (start, _), posted in zip(sends, posts)]
    q = statistics.quantiles(us, n=10)
    return {
        "send_p50_us": round(statistics.median(us), 1),
        "send_p90_us": round(q[8], 1),
        "send_mean_us": round(statistics.mean(us), 1),
        "rank1_lead_p10_p50_p90_us": [round(v) for v in statistics.quantiles(lead, n=10)[::4]],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--gc", choices=["on", "off"], default="on")
    args = p.parse_args()
    args.int32_tables, args.width_step = False, 16  # plan_broadcast's defaults
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(port, args, results), nprocs=2)
        print(json.dumps({kind: _summary(results[0][kind], results[1][kind]) for kind in KINDS}))


if __name__ == "__main__":
    main()
