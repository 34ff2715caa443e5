"""Offline throughput on the nano-vllm workload (DESIGN.md "Reference workloads"):
256 sequences, random.seed(0), prompt ids uniform in [0, 10000], input and output lengths
uniform in [100, 1024], ignore_eos, temperature 0.6. Prints output tokens / wall time
(prefill included) and the ratio to a roofline floor when given.

    python bench/offline.py --model-config ../shared/reference/configs/qwen3-0.6b.json
    python bench/offline.py --model DIR [--custom-module examples/reward_head.py]
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.config import EngineConfig  # noqa: E402
from coordinator.offline import LLM  # noqa: E402
from coordinator.sampling_params import SamplingParams  # noqa: E402


def workload(num_seqs: int, max_input: int, max_output: int, seed: int = 0):
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_new_tokens=random.randint(100, max_output)) for _ in range(num_seqs)]
    return prompts, params


def config_dir(config_json: str) -> str:
    """A checkpoint folder holding only config.json (for --load-format dummy)."""
    folder = tempfile.mkdtemp(prefix="tapserve-bench-")
    shutil.copy(config_json, Path(folder) / "config.json")
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (weights loaded)")
    p.add_argument("--model-config", help="config.json of a real model: random weights of its shapes")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--custom-module")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--floor-seconds", type=float, help="roofline floor to report the ratio to")
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    model = args.model or config_dir(args.model_config)
    config = EngineConfig(model=model, load_format="safetensors" if args.model else "dummy",
                          custom_module=args.custom_module, enforce_eager=args.enforce_eager,
                          max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    llm = LLM(config)
    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    in_tokens = sum(len(x) for x in prompts)
    figures = {"input_tokens": in_tokens, "output_tokens": out_tokens, "seconds": round(elapsed, 3),
               "output_tokens_per_s": round(out_tokens / elapsed, 1),
               "custom_module": args.custom_module, "kv_blocks": llm.runner.num_blocks}
    if args.floor_seconds:
        figures["ratio_to_floor"] = round(elapsed / args.floor_seconds, 2)
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
