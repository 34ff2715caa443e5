"""Prefill of one long prompt: model FLOP utilisation against F, a bf16 GEMM's throughput
measured first in the same run (bench/roofline.py).

python bench/prefill.py --model-config bench/configs/qwen3-8b.json --tokens 4096
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
from tapserve.bench.offline import config_dir  # noqa: E402
from tapserve.coordinator.config import EngineConfig  # noqa: E402
from tapserve.coordinator.offline import LLM  # noqa: E402


def model_flops(llm: LLM, tokens: int) -> float:
    """2 x matmul params x tokens + causal attention (QK^T and PV over half the square)."""
    cfg = llm.runner.model_cfg
    params = sum(
        p.numel()
        for n, p in llm.runner.model.named_parameters()
        if "norm" not in n and n != "embed_tokens.weight"
    )
    if cfg.tie_word_embeddings:
        params += cfg.vocab_size * cfg.hidden_size
    attn = (
        2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * tokens * tokens / 2
    )
    return 2 * params * tokens + attn


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-config", required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    roofline.add_arguments(p)
    args = p.parse_args()
    machine = roofline.measure("cuda", args.copy_bytes, args.gemm_size)
    print(roofline.describe(machine), flush=True)
    llm = LLM(
        EngineConfig(
            model=config_dir(args.model_config),
            load_format="dummy",
            max_model_len=args.tokens + 16,
            max_num_batched_tokens=args.tokens,
            max_num_seqs=8,
            enable_prefix_caching=False,
        )
    )
    params = SamplingParams(max_new_tokens=1, temperature=0)
    times = []
    for r in range(args.repeats + 1):
        prompt = [(r * 31 + i) % 30000 + 1 for i in range(args.tokens)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    best = min(times[1:])
    flops = model_flops(llm, args.tokens)
    print(
        json.dumps(
            {
                "tokens": args.tokens,
                "seconds": round(best, 4),
                "tflops": round(flops / best / 1e12, 1),
                "mfu": round(flops / best / machine["bf16_flops_per_s"], 3),
                "device_name": machine["device_name"],
            }
        )
    )


if __name__ == "__main__":
    main()
