"""Run under torchrun (or plain python): generate for the requests in a JSON file and, on rank 0,
write the results (tokens, last-position logits, custom outputs, handler calls per rank)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

runpy.run_path(str(Path(__file__).resolve().parents[2] / "_checkout.py"))
torch.set_num_threads(1)

from tapserve.api.sampling_params import SamplingParams  # noqa: E402
from tapserve.api.wire import RequestOutput  # noqa: E402
from tapserve.coordinator.config import EngineConfig  # noqa: E402
from tapserve.coordinator.startup import rank0_engine, stop_group  # noqa: E402


def main(spec_file: str, out_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    config = EngineConfig(**{"device": "cpu", **spec["engine"]})  # CPU unless the spec says cuda
    started = rank0_engine(config)
    if started is None:
        return  # a worker rank, done
    ctx, engine, channel = started
    results = {}
    preemptions = [0]
    schedule = engine.scheduler.schedule

    def counting_schedule():
        batch = schedule()
        preemptions[0] += len(batch.preempted)
        return batch

    engine.scheduler.schedule = counting_schedule
    # "one_at_a_time": each request runs alone to the end (batch-1 decode)
    groups = (
        [[i] for i in range(len(spec["requests"]))]
        if spec.get("one_at_a_time")
        else [range(len(spec["requests"]))]
    )
    for group in groups:
        for i in group:
            req = spec["requests"][i]
            engine.add_request(
                str(i),
                req["prompt"],
                SamplingParams(**req["params"]),
                req.get("custom_output_params"),
            )
        while engine.has_work():
            for out in engine.step():
                record(results, out)
    results["_free_blocks"] = [engine.blocks.num_free_blocks, engine.blocks.num_blocks]
    results["_preemptions"] = preemptions[0]
    results["_ahead_steps"] = engine.num_ahead_steps
    results["_backend"] = dist.get_backend() if dist.is_initialized() else None
    one_shot = engine.runner.tp.one_shot  # model/allreduce.py, TAPSERVE_ALLREDUCE
    results["_allreduce"] = "nccl" if one_shot is None else one_shot.mode
    Path(out_file).write_text(json.dumps(results))
    stop_group(channel)


def record(results: dict, out: RequestOutput) -> None:
    """Add one engine output to its request's results."""
    r = results.setdefault(out.request_id, {"tokens": {}, "custom_output": None})
    for s in out.sequences:
        r["tokens"].setdefault(str(s.index), []).extend(s.new_token_ids)
        r.setdefault("top_logprobs", []).extend(s.new_top_logprobs or [])
        if s.custom_output is not None:  # LAST_GENERATED: one value per sequence
            r.setdefault("seq_custom_output", {})[str(s.index)] = s.custom_output["data"].hex()
        if s.custom_rows is not None:  # multi-row selections: deltas with their positions
            rows = r.setdefault("seq_rows", {}).setdefault(str(s.index), [])
            rows.append([s.custom_rows["data"].hex(), s.custom_positions])
    if out.custom_output is not None:
        r["custom_output"] = {**out.custom_output, "data": out.custom_output["data"].hex()}
    if out.custom_rows is not None:
        r.setdefault("prompt_rows", []).append(
            [out.custom_rows["data"].hex(), out.custom_positions]
        )
    r["cached"] = out.num_cached_tokens


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
