"""Batch scoring over HTTP (`POST /custom_output`): the cost of many prompt positions per
prompt against one. Starts a server (`--launch`, as bench/serve.py; prefix caching off so every
round computes every prompt), then alternates rounds (16, 1, 1, 16, ...): each round sends
`--requests` concurrent /custom_output requests of `--prompts` token-id prompts, each prompt
scored at `--positions` evenly spaced positions ending at its last token, or at its last token
alone. Prints each round's wall time, the medians and the cost.

    python bench/scoring.py --launch "--model-config bench/configs/qwen3-0.6b.json \
        --custom-module bench/last_token_head.py:PairLinearHead" --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.bench.serve import expand_launch, start_server  # noqa: E402


def spread(length: int, count: int) -> list[int]:
    """count distinct positions spread evenly over [0, length), the last one included."""
    count = min(count, length)
    return sorted({length - 1 - (i * length) // count for i in range(count)})


def prompts(args: argparse.Namespace, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [
        [
            [
                rng.randint(0, args.max_token_id)
                for _ in range(rng.randint(args.min_len, args.max_len))
            ]
            for _ in range(args.prompts)
        ]
        for _ in range(args.requests)
    ]


async def score_round(url: str, batches: list[list[list[int]]], positions: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(batch: list[list[int]]) -> int:
            params = [{"position": spread(len(p), positions)} for p in batch]
            r = await client.post(
                "/custom_output", json={"prompts": batch, "custom_output_params": params}
            )
            r.raise_for_status()
            return sum(len(s.get("custom_output_positions", [0])) for s in r.json()["outputs"])

        start = time.perf_counter()
        rows = await asyncio.gather(*(one(b) for b in batches))
        return {"seconds": round(time.perf_counter() - start, 3), "rows": sum(rows)}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--launch", required=True, help="launch.py arguments (a custom module needed)")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--rounds", type=int, default=3, help="rounds of each arm")
    p.add_argument("--requests", type=int, default=16, help="concurrent requests a round")
    p.add_argument("--prompts", type=int, default=32, help="prompts per request")
    p.add_argument("--positions", type=int, default=16)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args()
    rounds: dict[int, list[float]] = {args.positions: [], 1: []}
    with tempfile.TemporaryDirectory(prefix="tapserve-bench-") as tmp:
        argv = expand_launch(args.launch, Path(tmp)) + ["--no-prefix-caching"]
        proc = start_server(argv, args.port)
        url = f"http://127.0.0.1:{args.port}"
        try:
            asyncio.run(score_round(url, prompts(args, -1)[:2], 1))  # warm-up
            for r in range(2 * args.rounds):
                arm = args.positions if r % 4 in (0, 3) else 1
                result = asyncio.run(score_round(url, prompts(args, r // 2), arm))
                rounds[arm].append(result["seconds"])
                print(json.dumps({"round": r, "positions": arm, **result}), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    median = {arm: statistics.median(v) for arm, v in rounds.items()}
    figures = {
        "rounds": rounds,
        "median_s": median,
        "cost_median": round(median[args.positions] / median[1] - 1, 4),
        "prompts_per_round": args.requests * args.prompts,
    }
    print(json.dumps(figures))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
