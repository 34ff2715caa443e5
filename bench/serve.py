"""HTTP serving benchmark: load generator for tapserve's OpenAI endpoint, and the relay cost.

Streams `/v1/completions` requests with token-id prompts (`ignore_eos`, so every request
produces exactly its output length) at a fixed concurrency or with Poisson arrivals, and
reports TTFT, TPOT, ITL (p50 / p99) and output tokens/s (vLLM's definitions: TPOT =
(latency - TTFT) / (output tokens - 1) per request; ITL = gaps between streamed chunks), SSE
events per token (events carrying tokens / tokens streamed) and the output tokens streamed.
The HTTP client (a lean HTTP/1.1 reader, so that the server is what is measured) runs in
processes of its own (`--client-procs`, requests dealt out in turn, one common start;
`--client-cores 12-15` pins them to those cores and a server started with --launch to the
others). `--rounds N` runs the workload N times and reports the round of median wall time.

    python bench/serve.py --url http://127.0.0.1:8000 --concurrency 64 --num-requests 256
    python bench/serve.py --request-rate 16 ...                 # Poisson arrivals
    # start the server itself, then run the same workload on the engine in-process
    # (no HTTP, no ZeroMQ) and print the relay cost = HTTP TPOT / engine TPOT - 1:
    python bench/serve.py --launch "--model-config ../shared/reference/configs/qwen3-0.6b.json" \
        --concurrency 64 --compare-engine
    # the demo model (vocabulary 1024): --launch "" --max-token-id 1000
    # bench/offline.py's nano-vllm workload over HTTP (133,966 output tokens), 256 streams:
    python bench/serve.py --launch "--model-config bench/configs/qwen3-0.6b.json --no-prefix-caching" \
        --workload nano-vllm --concurrency 256 --client-cores 12-15 --client-procs 4 \
        --rounds 3 --compare-engine
    # capacity under a latency target: Poisson rates, a table and a plot in --out-dir, and the
    # highest rate within --ttft-p99-ms / --tpot-p99-ms; --head last-prompt adds a custom
    # output on each request's last prompt token (the server needs a --custom-module whose
    # selector honours "position", e.g. bench/last_token_head.py:LastTokenLinearHead)
    python bench/serve.py --launch "--model-config bench/configs/qwen3-0.6b.json --no-prefix-caching" \
        --sweep-rates 2,4,8,16,32 --sweep-seconds 30 --out-dir sweep --client-cores 12-15

`--model-config FILE` inside --launch is expanded to `--model DIR --load-format dummy
--tokenizer TOK` with a synthetic word-level tokenizer of the config's vocabulary size (the
API process only needs a tokenizer whose ids cover the vocabulary).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
from pathlib import Path

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tapserve.bench.serve_client import (  # noqa: E402
    Result,
    client_pool,
    parse_cores,
    run_clients,
    warm_up,
)
from tapserve.bench.serve_engine import run_engine  # noqa: E402
from tapserve.bench.serve_figures import median_round, print_summary, summarize  # noqa: E402
from tapserve.bench.serve_launch import expand_launch, start_server  # noqa: E402
from tapserve.bench.serve_report import Targets, best_rate, sweep_plot, sweep_table  # noqa: E402


# ---- workload ------------------------------------------------------------------------------
def workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request; seeded. --workload nano-vllm: bench/offline.py's
    own workload (its 256 requests, each with its max_new_tokens)."""
    if args.workload == "nano-vllm":
        from tapserve.bench.offline import workload as nano_vllm

        prompts, params = nano_vllm(256, 1024, 1024)
        return [(prompt, p.max_new_tokens) for prompt, p in zip(prompts, params)]
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        lo, hi = int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))
        return max(1, rng.randint(lo, hi))

    return [
        (
            [rng.randint(0, args.max_token_id) for _ in range(length(args.input_len))],
            length(args.output_len),
        )
        for _ in range(args.num_requests)
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--launch", help="launch.py arguments: start the server here (own port)")
    p.add_argument("--port", type=int, default=8123, help="port for --launch")
    p.add_argument(
        "--compare-engine",
        action="store_true",
        help="with --launch: also run the engine in-process; print the relay cost",
    )
    p.add_argument(
        "--workload",
        choices=("random", "nano-vllm"),
        default="random",
        help="random: the lengths below; nano-vllm: bench/offline.py's 256 requests "
        "(the length and token-id options do not apply)",
    )
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument(
        "--concurrency",
        type=int,
        help="requests in flight at most, 0: unlimited (default: 64, unlimited with Poisson rates)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals per second (0: all at once, gated by --concurrency)",
    )
    p.add_argument(
        "--sweep-rates",
        help="comma-separated Poisson rates, each run on the same requests: a table and a plot "
        "in --out-dir and the highest rate within the targets",
    )
    p.add_argument(
        "--sweep-seconds",
        type=float,
        help="with --sweep-rates: each rate sends the first rate x this many requests (about "
        "this many seconds of arrivals) instead of --num-requests",
    )
    p.add_argument("--out-dir", default="serve_sweep", help="where --sweep-rates writes")
    p.add_argument("--label", default="", help="named in the sweep's title (GPU, model)")
    p.add_argument("--ttft-p99-ms", type=float, default=1000.0, help="the sweep's TTFT target")
    p.add_argument("--tpot-p99-ms", type=float, default=50.0, help="the sweep's TPOT target")
    p.add_argument(
        "--min-achieved",
        type=float,
        default=0.95,
        help="the sweep's least achieved / offered request rate",
    )
    p.add_argument(
        "--head",
        choices=("none", "last-prompt"),
        default="none",
        help='last-prompt: custom_output_params {"position": last prompt token} on each request',
    )
    p.add_argument(
        "--client-cores",
        help="pin the HTTP client's process to these cores (e.g. 12-15) and a --launch server "
        "to the others",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="HTTP client processes (requests dealt out in turn, one common start)",
    )
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--extra-body", help="JSON merged into every request body")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the workload this many times (each rate; --compare-engine too) and report "
        "the round of median wall time; with --launch, prefix caching must be off",
    )
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)  # (older commands)
    args = p.parse_args(argv)
    if args.rounds > 1 and args.launch is not None and "--no-prefix-caching" not in args.launch:
        p.error("--rounds repeats the prompts: add --no-prefix-caching to --launch")
    if args.sweep_rates and args.compare_engine:
        p.error("--compare-engine compares one run: leave out --sweep-rates")
    if args.sweep_rates and args.launch is not None and "--no-prefix-caching" not in args.launch:
        p.error(
            "--sweep-rates repeats the prompts at each rate: add --no-prefix-caching to --launch"
        )
    if args.sweep_seconds and args.sweep_rates:
        top = max(float(r) for r in args.sweep_rates.split(","))
        args.num_requests = max(2, math.ceil(top * args.sweep_seconds))
    return args


def requests_at(args: argparse.Namespace, items: list, rate: float) -> list:
    """The requests a rate sends: all, or with --sweep-seconds the first rate x seconds."""
    if not (args.sweep_seconds and rate):
        return items
    return items[: max(2, math.ceil(rate * args.sweep_seconds))]


def run_rates(
    args: argparse.Namespace, url: str, items: list[tuple[list[int], int]], rates: list[float]
) -> list[dict]:
    """The workload at each rate, in the client's own process: each rate's summary, with the
    output tokens the requests ask for (ignore_eos: each runs to its max_tokens)."""
    cores = parse_cores(args.client_cores) if args.client_cores else None
    runs = []
    with client_pool(cores, args.client_procs) as pool:
        if args.warmup:
            pool.submit(warm_up, args, url, [p for p, _ in items[: args.warmup]]).result()
        for rate in rates:
            sent = requests_at(args, items, rate)
            expected = sum(n for _, n in sent)
            rounds = []
            for _ in range(args.rounds):
                raw, wall, client_cores = run_clients(pool, args, url, sent, rate)
                rounds.append(summarize([Result(**r) for r in raw], wall))
            summary = median_round(rounds)
            runs.append(
                {
                    "rate": rate,
                    **summary,
                    "expected_output_tokens": expected,
                    "client_cores": client_cores,
                }
            )
            title = f"{rate:g} req/s" if rate else "all at once"
            print_summary(f"HTTP (streaming /v1/completions), {title}", runs[-1])
            if summary["output_tokens"] != expected:
                print(f"  output tokens streamed {summary['output_tokens']}, asked for {expected}")
    return runs


def report_sweep(args: argparse.Namespace, runs: list[dict]) -> float | None:
    """The sweep's table, plot and JSON in --out-dir; prints the table and the best rate."""
    targets = Targets(args.ttft_p99_ms, args.tpot_p99_ms, args.min_achieved)
    best = best_rate(runs, targets)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    server = f"--launch {args.launch!r}" if args.launch is not None else args.url
    label = f" {args.label}" if args.label else ""
    title = f"tapserve request-rate sweep{label} ({args.workload}, head {args.head})"
    best_line = f"highest rate within {targets.describe()}: " + (
        f"{best:g} req/s" if best is not None else "none of the rates"
    )
    text = f"{title}, {server}\n\n{sweep_table(runs, targets)}\n{best_line}\n"
    (out / "serve_sweep.md").write_text(text)
    (out / "serve_sweep.json").write_text(
        json.dumps({"args": vars(args), "best_rate": best, "runs": runs}, indent=1)
    )
    sweep_plot(runs, out / "serve_sweep.png", title, targets)
    print("\n" + text)
    return best


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rates = [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else None
    if args.concurrency is None:
        args.concurrency = 0 if rates or args.request_rate else 64
    client_cores = parse_cores(args.client_cores) if args.client_cores else set()
    server_cores = os.sched_getaffinity(0) - client_cores if client_cores else None
    items = workload(args)
    figures: dict = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="tapserve-bench-") as tmp:
        launch_argv = expand_launch(args.launch, Path(tmp)) if args.launch is not None else None
        proc = None
        if launch_argv is not None:
            proc = start_server(launch_argv, args.port, server_cores or None)
        url = f"http://127.0.0.1:{args.port}" if proc else args.url
        try:
            runs = run_rates(args, url, items, rates or [args.request_rate])
        finally:
            if proc:
                proc.terminate()
                proc.wait(60)
        if rates:
            figures["best_rate"] = report_sweep(args, runs)
            figures["sweep"] = runs
        else:
            figures["http"] = runs[0]
        if args.compare_engine and launch_argv is not None:
            figures["engine"] = run_engine(launch_argv, args, items)
            print_summary("engine in-process", figures["engine"])
            relay = figures["http"]["tpot_ms"]["mean"] / figures["engine"]["tpot_ms"]["mean"] - 1
            walls = figures["http"]["wall_s"] / figures["engine"]["wall_s"]
            figures["relay_cost_tpot"], figures["wall_ratio"] = relay, walls
            print(f"\nrelay cost (mean TPOT, HTTP vs engine): {relay * 100:+.1f} %")
            print(f"wall time, HTTP / engine in-process: {walls:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
