"""Best-of-n with a reward head on the last generated token (issue 9): one pass that scores each
sample as it finishes (LAST_GENERATED), against generation followed by a separate scoring
request (prompt + sample, max_new_tokens = 0) per sample. Prints wall time and tokens/s.

    python bench/best_of_n.py                                   # embedded demo model, CPU
    python bench/best_of_n.py --model-config bench/configs/qwen3-0.6b.json   # GPU, dummy weights
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.api.sampling_params import SamplingParams  # noqa: E402
from tapserve.bench.offline import config_dir  # noqa: E402
from tapserve.coordinator.config import EngineConfig  # noqa: E402
from tapserve.coordinator.offline import LLM  # noqa: E402

HEAD = "bench/last_generated_head.py:LastGeneratedRewardHead"


def run_one_pass(llm: LLM, prompts, n: int, max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(
        n=n, temperature=0.8, max_new_tokens=max_tokens, ignore_eos=True, seed=1
    )
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(o.custom_output is not None for r in results for o in r.outputs)
    return elapsed, sum(len(o.token_ids) for r in results for o in r.outputs)


def run_two_pass(llm: LLM, prompts, n: int, max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(
        n=n, temperature=0.8, max_new_tokens=max_tokens, ignore_eos=True, seed=1
    )
    start = time.perf_counter()
    results = llm.generate(prompts, params, custom_output_params=[{"mode": "none"}] * len(prompts))
    scoring = [r.prompt_token_ids + o.token_ids for r in results for o in r.outputs]
    scores = llm.generate(
        scoring,
        SamplingParams(max_new_tokens=0),
        custom_output_params=[{"mode": "last_prompt_token"}] * len(scoring),
    )
    elapsed = time.perf_counter() - start
    assert all(s.custom_output is not None for s in scores)
    return elapsed, sum(len(o.token_ids) for r in results for o in r.outputs)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-config", help="config.json: random weights of its shapes (else the demo model)"
    )
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    config = EngineConfig(
        model=config_dir(args.model_config) if args.model_config else None,
        load_format="dummy" if args.model_config else "safetensors",
        custom_module=HEAD,
        enable_prefix_caching=True,
    )
    llm = LLM(config)
    rng = random.Random(0)
    vocab = llm.runner.model_cfg.vocab_size
    prompts = [
        [rng.randrange(vocab - 8) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    run_one_pass(llm, prompts[:1], 2, 4)  # warm-up
    one_s, tokens = run_one_pass(llm, prompts, args.n, args.max_tokens)
    two_s, _ = run_two_pass(llm, prompts, args.n, args.max_tokens)
    print(
        json.dumps(
            {
                "prompts": args.prompts,
                "n": args.n,
                "prompt_len": args.prompt_len,
                "max_tokens": args.max_tokens,
                "generated_tokens": tokens,
                "last_generated_s": round(one_s, 3),
                "last_generated_tok_s": round(tokens / one_s, 1),
                "separate_scoring_s": round(two_s, 3),
                "separate_scoring_tok_s": round(tokens / two_s, 1),
                "speedup": round(two_s / one_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
