"""Load test against a live CPU server (embedded demo model, demo head): nothing lost.

Starts `python launch.py` itself (tests/api_helpers.LiveServer), then sends `--requests`
requests with at most `--concurrency` in flight: a seeded mix of `/v1/completions` and
`/v1/chat/completions`, streaming and not, `n` 1-3, `ignore_eos` with a fixed `max_tokens`
per request, custom outputs on (the demo head scores every prompt). Checks:

- every request got exactly one complete answer: HTTP 200; non-streaming: n choices, each
  index once, `finish_reason` "length", exactly `max_tokens` tokens per choice (counted from
  logprobs) and `usage.completion_tokens == n * max_tokens`; streaming: exactly one `[DONE]`,
  last, no error event, one `finish_reason` per choice, `max_tokens` tokens per choice, usage
  as above; every choice carries `extra_outputs.custom_output`;
- at the end every KV block is free (`tapserve_kv_blocks_used` == 0 on /metrics) and no
  request is in flight;
- RSS (VmRSS from /proc) of rank 0 (launch.py) and the API process before (after a warm-up)
  and after the run.

Prints a JSON summary; exit status 0 when every check passed.

    python bench/load_test.py                              # 2,000 requests, 256 concurrent
    python bench/load_test.py --requests 200 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

from tests.helpers.api import LiveServer, metric, wait_for  # noqa: E402
from tests.helpers.procs import api_pid, rss_kib  # noqa: E402

API_KEY = "load-test-key"
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
    "rho sigma tau upsilon phi chi psi omega the quick brown fox jumps over lazy dog"
).split()


# ---- processes ------------------------------------------------------------------------------
def rss(pids: dict[str, int]) -> dict[str, int]:
    return {name: rss_kib(pid) for name, pid in pids.items()}


# ---- one request ----------------------------------------------------------------------------
def make_request(i: int, rng: random.Random) -> dict:
    chat = rng.random() < 0.3
    spec = {
        "i": i,
        "chat": chat,
        "stream": rng.random() < 0.5,
        "n": rng.randint(1, 3),
        "max_tokens": rng.randint(1, 24),
    }
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    body = {
        "model": "tapserve-demo",
        "max_tokens": spec["max_tokens"],
        "n": spec["n"],
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": i,
        "stream": spec["stream"],
    }
    if chat:
        body.update(messages=[{"role": "user", "content": text}], logprobs=True)
    else:
        body.update(prompt=text, logprobs=0)
    if spec["stream"]:
        body["stream_options"] = {"include_usage": True}
    spec["path"] = "/v1/chat/completions" if chat else "/v1/completions"
    spec["body"] = body
    return spec


def _choice_tokens(choice: dict, chat: bool) -> int:
    lp = choice.get("logprobs") or {}
    return len(lp.get("content") or []) if chat else len(lp.get("tokens") or [])


def _has_value(obj: dict) -> bool:
    return "custom_output" in (obj.get("extra_outputs") or {})


def check_plain(spec: dict, status: int, data: dict) -> str | None:
    if status != 200:
        return f"HTTP {status}: {str(data)[:200]}"
    n, want = spec["n"], spec["max_tokens"]
    choices = data.get("choices") or []
    if sorted(c["index"] for c in choices) != list(range(n)):
        return f"choice indices {[c['index'] for c in choices]}, want {n}"
    for c in choices:
        if c.get("finish_reason") != "length":
            return f"choice {c['index']} finish_reason {c.get('finish_reason')}"
        if _choice_tokens(c, spec["chat"]) != want:
            return f"choice {c['index']}: {_choice_tokens(c, spec['chat'])} tokens, want {want}"
        if not _has_value(c):
            return f"choice {c['index']} has no custom output"
    if data["usage"]["completion_tokens"] != n * want:
        return f"usage {data['usage']}, want {n * want} completion tokens"
    return None


def check_stream(spec: dict, events: list[str]) -> str | None:
    n, want = spec["n"], spec["max_tokens"]
    if events.count("[DONE]") != 1 or events[-1] != "[DONE]":
        return f"[DONE] {events.count('[DONE]')} times / not last: {events[-2:]}"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens, finishes, valued = [0] * n, [0] * n, [False] * n
    usage = None
    for chunk in chunks:
        if "error" in chunk:
            return f"error event {chunk['error']}"
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            k = c["index"]
            tokens[k] += _choice_tokens(c, spec["chat"])
            finishes[k] += c.get("finish_reason") is not None
            valued[k] |= _has_value(c)
    if tokens != [want] * n:
        return f"tokens per choice {tokens}, want {want}"
    if finishes != [1] * n:
        return f"finish reasons per choice {finishes}"
    if not all(valued):
        return f"custom output per choice {valued}"
    if usage is None or usage["completion_tokens"] != n * want:
        return f"usage {usage}, want {n * want}"
    return None


async def send(client: httpx.AsyncClient, spec: dict) -> str | None:
    try:
        if not spec["stream"]:
            r = await client.post(spec["path"], json=spec["body"])
            try:
                data = r.json()
            except ValueError:
                data = {"raw": r.text[:200]}
            return check_plain(spec, r.status_code, data)
        async with client.stream("POST", spec["path"], json=spec["body"]) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        return check_stream(spec, events)
    except Exception as e:  # noqa: BLE001 - any failure is a lost request
        return f"{type(e).__name__}: {e}"


async def drive(server: LiveServer, specs: list[dict], concurrency: int) -> list[str | None]:
    sem = asyncio.Semaphore(concurrency)
    # keep-alive expiry below uvicorn's 5 s timeout_keep_alive: otherwise a pooled connection the
    # server is just closing can be reused (the client then sees a ReadError, see docs)
    limits = httpx.Limits(
        max_connections=concurrency + 8, max_keepalive_connections=concurrency, keepalive_expiry=2.0
    )

    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, timeout=1800, limits=limits
    ) as client:

        async def one(spec):
            async with sem:
                return await send(client, spec)

        return await asyncio.gather(*(one(s) for s in specs))


# ---- the run -------------------------------------------------------------------------------
def run(
    requests: int = 2000, concurrency: int = 256, seed: int = 0, server_args: tuple[str, ...] = ()
) -> dict:
    rng = random.Random(seed)
    specs = [make_request(i, rng) for i in range(requests)]
    server = LiveServer(*server_args, api_key=API_KEY)
    try:
        pids = {"rank0": server.proc.pid, "api": api_pid(server.proc.pid)}
        asyncio.run(drive(server, [make_request(-1 - i, random.Random(i)) for i in range(16)], 16))
        rss_before = rss(pids)
        start = time.monotonic()
        errors = asyncio.run(drive(server, specs, concurrency))
        wall = time.monotonic() - start
        blocks_free = wait_for(lambda: metric(server, "tapserve_kv_blocks_used") == 0, 10)
        in_flight = metric(server, "tapserve_api_requests_in_flight")
        rss_after = rss(pids)
        failed = [(s["i"], e) for s, e in zip(specs, errors) if e is not None]
        tokens = sum(s["n"] * s["max_tokens"] for s in specs)
        summary = {
            "requests": requests,
            "concurrency": concurrency,
            "seed": seed,
            "streaming": sum(s["stream"] for s in specs),
            "chat": sum(s["chat"] for s in specs),
            "n_counts": {k: sum(s["n"] == k for s in specs) for k in (1, 2, 3)},
            "completed_ok": requests - len(failed),
            "failed": len(failed),
            "failures": failed[:20],
            "expected_output_tokens": tokens,
            "wall_s": round(wall, 1),
            "output_tok_per_s": round(tokens / wall, 1),
            "requests_per_s": round(requests / wall, 2),
            "kv_blocks_used_at_end": metric(server, "tapserve_kv_blocks_used"),
            "kv_blocks_total": metric(server, "tapserve_kv_blocks_total"),
            "all_blocks_free": blocks_free,
            "api_requests_in_flight_at_end": in_flight,
            "rss_kib_before": rss_before,
            "rss_kib_after": rss_after,
            "rss_growth_kib": {k: rss_after[k] - rss_before[k] for k in pids},
            "server_alive": server.proc.poll() is None,
        }
        summary["ok"] = not failed and blocks_free and in_flight == 0 and summary["server_alive"]
    finally:
        code = server.stop()
    summary["server_exit_code"] = code
    summary["ok"] = summary["ok"] and code == 0
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra launch.py argument (repeatable), e.g. --server-arg=--output-workers=2",
    )
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    summary = run(args.requests, args.concurrency, args.seed, tuple(args.server_arg))
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
