"""The peer on the nano-vllm workload: Hugging Face transformers' own continuous batching
(`init_continuous_batching`, what `generate_batch` runs) on the same 256 requests as
bench/offline.py (random.seed(0), prompt and output lengths uniform in [100, 1024], each
request's own max_new_tokens, temperature 0.6, no EOS), random bf16 weights in the shapes of
a config.json. Prints output tokens / wall time and, given our time, the ratio.

    python bench/hf_peer.py --model-config bench/configs/qwen3-0.6b.json [--ours-seconds 5.29]

It takes minutes on an H200 (206.99 s on 2026-11-30; 222.9 s in shared/gpu/README.md),
so it is a command of its own. The clock starts after `manager.start()` returns, just
before the first request is added. `--num-seqs 4 --max-input 110 --max-output 105` runs a small case (CPU too)
to check the script (lengths are drawn from [100, max]).
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

from tapserve.bench.offline import workload  # noqa: E402


def load_model(config_json: str, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(Path(config_json).read_text())
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def run(
    model, prompts: list[list[int]], max_new: list[int], time_limit: float
) -> tuple[float, int, int]:
    """(seconds, output tokens, requests finished) through one continuous-batching manager;
    at time_limit seconds it stops waiting and reports what finished by then."""
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_p=1.0,
        top_k=0,
        max_new_tokens=max(max_new),
        eos_token_id=-1,
        pad_token_id=0,
    )
    manager = model.init_continuous_batching(generation_config=gen)
    manager.start()
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, max_new)):
        manager.add_request(prompt, request_id=str(i), max_new_tokens=n)
    done: dict[str, int] = {}
    while len(done) < len(prompts) and time.perf_counter() - start < time_limit:
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id}: {result.error}")
            done[result.request_id] = len(result.generated_tokens)
        elif result is None and not manager.is_running():
            raise RuntimeError("the manager stopped before every request finished")
    seconds = time.perf_counter() - start
    manager.stop(block=len(done) == len(prompts))
    short = {rid: n for rid, n in done.items() if n != max_new[int(rid)]}
    if short:
        print(json.dumps({"requests_not_at_their_length": len(short)}))
    return seconds, sum(done.values()), len(done)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model-config", required=True, help="a config.json (random weights)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--ours-seconds", type=float, help="tapserve's time on the same workload")
    p.add_argument(
        "--time-limit",
        type=float,
        default=3600,
        help="stop waiting after this many seconds and report the requests finished",
    )
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(args.model_config, device)
    prompts, params = workload(args.num_seqs, args.max_input, args.max_output)
    seconds, tokens, finished = run(
        model, prompts, [sp.max_new_tokens for sp in params], args.time_limit
    )
    import transformers

    out = {
        "peer": f"transformers {transformers.__version__} continuous batching",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "seconds": round(seconds, 3),
        "requests_finished": f"{finished} of {len(prompts)}",
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / seconds, 1),
    }
    if args.ours_seconds and finished == len(prompts):
        out["ratio_to_ours"] = round(seconds / args.ours_seconds, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
