"""The relay-cost baseline of bench/serve.py: the same workload on the engine in-process (no
HTTP, no ZeroMQ, no detokenization), with the server's flags."""

from __future__ import annotations

import argparse
import time

from tapserve.bench.serve_client import Result
from tapserve.bench.serve_figures import median_round, summarize


def run_engine(
    launch_argv: list[str], args: argparse.Namespace, items: list[tuple[list[int], int]]
) -> dict:
    """The same workload at the same concurrency on coordinator.engine.Engine directly, its
    median round's summary; per-request timestamps of each step's outputs play the role of
    streamed chunks."""
    from tapserve import launch_flags
    from tapserve.api.gc_policy import settle_after_startup
    from tapserve.api.sampling_params import SamplingParams
    from tapserve.coordinator.startup import build_engine, build_runner

    config = launch_flags.engine_config(launch_flags.parse_args(launch_argv))
    engine = build_engine(config, build_runner(config))
    settle_after_startup()  # as the served rank 0 (launch.py)
    warm = [(p, 8) for p, _ in items[: args.warmup]]
    rounds = []
    for batch, measure in [(warm, False)] + [(items, True)] * args.rounds:
        results: dict[str, Result] = {}
        added: dict[str, float] = {}
        last: dict[str, float] = {}
        in_flight: set[str] = set()
        pending = list(enumerate(batch))
        limit = args.concurrency or len(batch)
        start = time.perf_counter()
        while pending or engine.has_work():
            while pending and len(in_flight) < limit:
                i, (prompt, n) = pending.pop(0)
                rid = f"bench-{measure}-{i}"
                engine.add_request(
                    rid, prompt, SamplingParams(max_new_tokens=n, temperature=0.6, ignore_eos=True)
                )
                added[rid] = time.perf_counter()
                in_flight.add(rid)
            for out in engine.step():
                now = time.perf_counter()
                res = results.setdefault(out.request_id, Result())
                new = sum(len(s.new_token_ids) for s in out.sequences)
                if new:
                    if out.request_id in last:
                        res.itl.append(now - last[out.request_id])
                    else:
                        res.ttft = now - added[out.request_id]
                    last[out.request_id] = now
                    res.output_tokens += new
                if out.finished:
                    res.latency = now - added[out.request_id]
                    in_flight.discard(out.request_id)
        if measure:
            rounds.append(summarize(list(results.values()), time.perf_counter() - start))
    return median_round(rounds)
