"""HTTP serving benchmark: load generator for tapserve's OpenAI endpoint, and the relay cost.

Streams `/v1/completions` requests with token-id prompts (`ignore_eos`, so every request
produces exactly its output length) at a fixed concurrency or with Poisson arrivals, and
reports TTFT, TPOT, ITL (p50 / p99) and output tokens/s (vLLM's definitions: TPOT =
(latency - TTFT) / (output tokens - 1) per request; ITL = gaps between streamed chunks).

    python bench/serve.py --url http://127.0.0.1:8000 --concurrency 64 --num-requests 256
    python bench/serve.py --request-rate 16 ...                 # Poisson arrivals
    # start the server itself, then run the same workload on the engine in-process
    # (no HTTP, no ZeroMQ) and print the relay cost = HTTP TPOT / engine TPOT - 1:
    python bench/serve.py --launch "--model-config ../shared/reference/configs/qwen3-0.6b.json" \
        --concurrency 64 --compare-engine
    # the demo model (vocabulary 1024): --launch "" --max-token-id 1000

`--model-config FILE` inside --launch is expanded to `--model DIR --load-format dummy
--tokenizer TOK` with a synthetic word-level tokenizer of the config's vocabulary size (the
API process only needs a tokenizer whose ids cover the vocabulary).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))


@dataclass
class Result:
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


# ---- workload ------------------------------------------------------------------------------
def workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request; seeded."""
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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    ms = 1000.0
    out = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "wall_s": wall,
        "output_tokens": sum(r.output_tokens for r in ok),
        "output_tok_per_s": sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
    }
    for name, values in (
        ("ttft_ms", [r.ttft for r in ok]),
        ("tpot_ms", tpot),
        ("itl_ms", itl),
        ("latency_ms", [r.latency for r in ok]),
    ):
        out[name] = {
            "mean": statistics.fmean(values) * ms if values else float("nan"),
            "p50": percentile(values, 50) * ms,
            "p99": percentile(values, 99) * ms,
        }
    errors = sorted({r.error for r in results if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


def print_summary(title: str, s: dict) -> None:
    print(f"\n== {title} ==")
    print(
        f"requests {s['requests']} (failed {s['failed']}), wall {s['wall_s']:.2f} s, "
        f"{s['output_tok_per_s']:.1f} output tok/s, {s['requests_per_s']:.2f} req/s"
    )
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
        v = s[name]
        print(f"  {name:<11} mean {v['mean']:9.2f}  p50 {v['p50']:9.2f}  p99 {v['p99']:9.2f}")
    for e in s.get("errors", []):
        print("  error:", e)


# ---- HTTP client ---------------------------------------------------------------------------
async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, extra: dict
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.6,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    res, start = Result(), time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - start
    return res


async def run_http(args: argparse.Namespace, url: str, items: list[tuple[list[int], int]]):
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency or 0, 1) + 64)
    extra = json.loads(args.extra_body) if args.extra_body else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        if args.warmup:
            await asyncio.gather(
                *(one_request(c, model, p, 8, extra) for p, _ in items[: args.warmup])
            )
        gate = asyncio.Semaphore(args.concurrency or len(items))
        bar = tqdm(total=len(items), desc="requests", disable=args.no_progress)
        rng = random.Random(args.seed + 1)

        async def limited(prompt: list[int], n: int) -> Result:
            async with gate:
                result = await one_request(c, model, prompt, n, extra)
            bar.update(1)
            return result

        tasks, start = [], time.perf_counter()
        for prompt, n in items:
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        bar.close()
    return results, wall


# ---- the engine in-process (the relay-cost baseline) ---------------------------------------
def run_engine(
    launch_argv: list[str], args: argparse.Namespace, items: list[tuple[list[int], int]]
) -> tuple[list[Result], float]:
    """The same workload at the same concurrency on coordinator.engine.Engine directly;
    per-request timestamps of each step's outputs play the role of streamed chunks."""
    from tapserve import launch
    from tapserve.api.sampling_params import SamplingParams
    from tapserve.coordinator.startup import build_engine, build_runner

    config = launch.engine_config(launch.parse_args(launch_argv))
    engine = build_engine(config, build_runner(config))
    warm = [(p, 8) for p, _ in items[: args.warmup]]
    for batch, measure in ((warm, False), (items, True)):
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
        wall = time.perf_counter() - start
    return list(results.values()), wall


# ---- server launch -------------------------------------------------------------------------
def synthetic_tokenizer(vocab_size: int, folder: Path) -> None:
    """A word-level tokenizer with ids 0..vocab_size-1 ("t0", "t1", ...), nothing special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i} ": i for i in range(vocab_size)}, unk_token="t0 "))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")


def expand_launch(launch: str, workdir: Path) -> list[str]:
    """--model-config FILE -> --model DIR --load-format dummy --tokenizer TOK."""
    argv = shlex.split(launch)
    if "--model-config" in argv:
        i = argv.index("--model-config")
        config_file = Path(argv[i + 1])
        model_dir, tok_dir = workdir / "model", workdir / "tokenizer"
        model_dir.mkdir()
        tok_dir.mkdir()
        shutil.copy(config_file, model_dir / "config.json")
        synthetic_tokenizer(json.loads(config_file.read_text())["vocab_size"], tok_dir)
        argv[i : i + 2] = [
            "--model",
            str(model_dir),
            "--load-format",
            "dummy",
            "--tokenizer",
            str(tok_dir),
        ]
    return argv


def start_server(argv: list[str], port: int, timeout: float = 900) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "launch.py", *argv, "--port", str(port)], cwd=ROOT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"launch.py exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("server did not become healthy")


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
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64, help="0: unlimited")
    p.add_argument(
        "--request-rate",
        type=float,
        default=0.0,
        help="Poisson arrivals per second (0: all at once, gated by --concurrency)",
    )
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--extra-body", help="JSON merged into every request body")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    items = workload(args)
    figures: dict = {"args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="tapserve-bench-") as tmp:
        launch_argv = expand_launch(args.launch, Path(tmp)) if args.launch is not None else None
        proc = start_server(launch_argv, args.port) if launch_argv is not None else None
        url = f"http://127.0.0.1:{args.port}" if proc else args.url
        try:
            results, wall = asyncio.run(run_http(args, url, items))
        finally:
            if proc:
                proc.terminate()
                proc.wait(60)
        figures["http"] = summarize(results, wall)
        print_summary("HTTP (streaming /v1/completions)", figures["http"])
        if args.compare_engine and launch_argv is not None:
            results, wall = run_engine(launch_argv, args, items)
            figures["engine"] = summarize(results, wall)
            print_summary("engine in-process", figures["engine"])
            relay = figures["http"]["tpot_ms"]["mean"] / figures["engine"]["tpot_ms"]["mean"] - 1
            figures["relay_cost_tpot"] = relay
            print(f"\nrelay cost (mean TPOT, HTTP vs engine): {relay * 100:+.1f} %")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
