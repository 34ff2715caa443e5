"""bench/serve.py's HTTP client: streamed `/v1/completions` requests timed per token, run in a
process of its own (spawned, optionally pinned to cores the server does not use)."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class Result:
    """One request: seconds to the first token and to the end, gaps between token events,
    tokens streamed (the usage chunk's count) and the SSE events that carried them."""

    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    token_events: int = 0
    error: str | None = None


def carries_tokens(choice: dict) -> bool:
    """Whether a streamed completion choice carries tokens: a chunk is sent only for text,
    tokens, custom-output rows or a finish, so one without text carries tokens unless it
    brings the finish reason (rows arrive with the step's token)."""
    return bool(choice.get("text")) or choice.get("finish_reason") is None


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
                if carries_tokens(chunk["choices"][0]):
                    res.token_events += 1
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - start
    return res


def request_extras(args: argparse.Namespace, prompt: list[int]) -> dict:
    """--extra-body, and with --head last-prompt the custom output on the last prompt token."""
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if args.head == "last-prompt":
        extra["custom_output_params"] = {"position": len(prompt) - 1}
    return extra


async def run_http(
    args: argparse.Namespace, url: str, items: list[tuple[list[int], int]], rate: float
) -> tuple[list[Result], float]:
    """The workload against `url`: Poisson arrivals at `rate` per second (0: all at once),
    at most args.concurrency in flight (0: no limit)."""
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=(args.concurrency or len(items)) + 64)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        if args.warmup:
            await asyncio.gather(
                *(
                    one_request(c, model, p, 8, request_extras(args, p))
                    for p, _ in items[: args.warmup]
                )
            )
        gate = asyncio.Semaphore(args.concurrency or len(items))
        bar = tqdm(total=len(items), desc="requests", disable=args.no_progress)
        rng = random.Random(args.seed + 1)

        async def limited(prompt: list[int], n: int) -> Result:
            async with gate:
                result = await one_request(c, model, prompt, n, request_extras(args, prompt))
            bar.update(1)
            return result

        tasks, start = [], time.perf_counter()
        for prompt, n in items:
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        bar.close()
    return results, wall


def client_run(
    args: argparse.Namespace, url: str, items: list[tuple[list[int], int]], rate: float
) -> tuple[list[dict], float, list[int]]:
    """run_http in the client process: its results as dicts (plain data crosses processes),
    the wall time and the cores the process may run on."""
    results, wall = asyncio.run(run_http(args, url, items, rate))
    return [asdict(r) for r in results], wall, sorted(os.sched_getaffinity(0))


def parse_cores(spec: str) -> set[int]:
    """'12-15' or '0,2,4-7' -> {cores}."""
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def client_pool(cores: set[int] | None) -> ProcessPoolExecutor:
    """One process (spawned: no state of this one) for the HTTP client, pinned to `cores`."""
    return ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=os.sched_setaffinity if cores else None,
        initargs=(0, cores) if cores else (),
    )
