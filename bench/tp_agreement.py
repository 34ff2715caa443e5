"""Top-1 agreement between TP degrees, teacher-forced, bf16, on a random checkpoint of a real
model's shapes (issue 7 item 1). The same fixed token sequences are scored at every position
by each degree; positions where TP1's top-2 logprob margin exceeds --margin count as
confident (random weights give many near-ties, where bf16 rounding alone flips the top-1).

    python bench/tp_agreement.py make --model-config bench/configs/qwen3-8b.json --out /tmp/q8
    torchrun --standalone --nproc-per-node=1 bench/tp_agreement.py score --model /tmp/q8 --json tp1.json
    torchrun --standalone --nproc-per-node=2 bench/tp_agreement.py score --model /tmp/q8 --json tp2.json
    python bench/tp_agreement.py compare tp1.json tp2.json

`make` writes the checkpoint with transformers' own `from_config` + `save_pretrained`, so every
degree loads the same weights through the real loader.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))


def make(args) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(Path(args.model_config).read_text()))
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out, max_shard_size="5GB")


def sequences(num: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


def score(args) -> None:
    from tapserve.api.sampling_params import SamplingParams
    from tapserve.coordinator.config import EngineConfig
    from tapserve.coordinator.startup import rank0_engine, stop_group

    started = rank0_engine(
        EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=1024)
    )
    if started is None:
        return  # a worker rank, done
    ctx, engine, channel = started
    params = SamplingParams(max_new_tokens=1, temperature=0, logprobs=True, top_logprobs=2)
    seqs = sequences(args.num_seqs, args.prompt_len + args.positions, engine.options.vocab_size)
    for i, seq in enumerate(seqs):
        for k in range(args.prompt_len, len(seq)):
            engine.add_request(f"{i}:{k}", seq[:k], params)
    top = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished and out.sequences and out.sequences[0].new_top_logprobs:
                (t1, l1), (_, l2) = out.sequences[0].new_top_logprobs[0][:2]
                top[out.request_id] = [t1, l1 - l2]
    Path(args.json).write_text(json.dumps({"tp": ctx.world_size, "top1": top}))
    stop_group(channel)


def compare(args) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (args.reference, args.other))
    keys = sorted(a["top1"])
    same = [a["top1"][k][0] == b["top1"][k][0] for k in keys]
    confident = [s for k, s in zip(keys, same) if a["top1"][k][1] > args.margin]
    print(
        json.dumps(
            {
                "reference_tp": a["tp"],
                "other_tp": b["tp"],
                "positions": len(keys),
                "agreement": round(sum(same) / len(same), 4),
                "confident_positions": len(confident),
                "margin": args.margin,
                "confident_agreement": round(sum(confident) / max(len(confident), 1), 4),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--model-config", required=True)
    m.add_argument("--out", required=True)
    s = sub.add_parser("score")
    s.add_argument("--model", required=True)
    s.add_argument("--json", required=True)
    s.add_argument("--device", default="cuda")
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--num-seqs", type=int, default=8)
    s.add_argument("--prompt-len", type=int, default=64)
    s.add_argument("--positions", type=int, default=64)
    c = sub.add_parser("compare")
    c.add_argument("reference")
    c.add_argument("other")
    c.add_argument("--margin", type=float, default=0.1)
    args = p.parse_args()
    {"make": make, "score": score, "compare": compare}[args.cmd](args)


if __name__ == "__main__":
    main()
