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
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx


@dataclass
class Result:
    """One request: seconds to the first token and to the end, gaps between token events,
    tokens streamed (the usage chunk's count) and the SSE events that carried them; its
    arrival (when it was due) and end in seconds from the run's start."""

    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    token_events: int = 0
    error: str | None = None
    arrival: float = 0.0
    ended: float = 0.0


def carries_tokens(choice: dict) -> bool:
    """Whether a streamed completion choice carries tokens: a chunk is sent only for text,
    tokens, custom-output rows or a finish, so one without text carries tokens unless it
    brings the finish reason (rows arrive with the step's token)."""
    return bool(choice.get("text")) or choice.get("finish_reason") is None


async def sse_data(
    url: str, path: str, body: dict, headers: dict[str, str]
) -> AsyncIterator[bytes]:
    """POST body as JSON on a connection of its own and yield each SSE event's data (HTTP/1.1
    with chunked or sized bodies; a lean client, so that the server, not the client, is
    measured). Raises ClientError for a status other than 200."""
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port or 80)
    try:
        payload = json.dumps(body).encode()
        head = [f"POST {path} HTTP/1.1", f"Host: {address.netloc}", "Connection: close"]
        head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        status = int((await reader.readline()).split()[1])
        chunked, length = False, None
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            chunked |= name == "transfer-encoding" and "chunked" in value
            length = int(value) if name == "content-length" else length
        if status != 200:
            body_bytes = await (reader.readexactly(length) if length else reader.read(300))
            raise ClientError(f"HTTP {status}: {body_bytes[:200]!r}")
        buffer = b""
        while chunk := await _next_chunk(reader, chunked):
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:]
    finally:
        writer.close()


async def _next_chunk(reader: asyncio.StreamReader, chunked: bool) -> bytes:
    """The body's next piece (b"" at its end)."""
    if not chunked:
        return await reader.read(1 << 16)
    size = int((await reader.readline()).split(b";")[0], 16)
    data = await reader.readexactly(size + 2)  # the chunk and its CRLF
    return data[:-2]


class ClientError(Exception):
    pass


async def one_request(
    url: str, headers: dict[str, str], model: str, prompt: list[int], max_tokens: int, extra: dict
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
        async for data in sse_data(url, "/v1/completions", body, headers):
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = chunk["error"]["message"]
                break
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
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError, ClientError) as e:
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
    args: argparse.Namespace, url: str, share: list[tuple[float, list[int], int]], start_at: float
) -> tuple[list[Result], float]:
    """This process's share of the workload against `url`: each request sent at its arrival
    time (seconds after start_at, time.monotonic()), at most its share of args.concurrency in
    flight. Returns the results and when the last one ended."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=url, headers=headers) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
    limit = -(-args.concurrency // args.client_procs) if args.concurrency else len(share)
    gate = asyncio.Semaphore(max(1, limit))

    async def arriving(at: float, prompt: list[int], n: int) -> Result:
        await asyncio.sleep(max(0.0, start_at + at - time.monotonic()))
        async with gate:
            res = await one_request(url, headers, model, prompt, n, request_extras(args, prompt))
        res.arrival, res.ended = at, time.monotonic() - start_at
        return res

    results = await asyncio.gather(*(arriving(at, p, n) for at, p, n in share))
    return list(results), time.monotonic()


def client_run(
    args: argparse.Namespace, url: str, share: list[tuple[float, list[int], int]], start_at: float
) -> tuple[list[dict], float, list[int]]:
    """run_http in a client process: its results as dicts (plain data crosses processes),
    when its last request ended and the cores the process may run on."""
    results, ended = _event_loop_run(run_http(args, url, share, start_at))
    return [asdict(r) for r in results], ended, sorted(os.sched_getaffinity(0))


def warm_up(args: argparse.Namespace, url: str, prompts: list[list[int]]) -> None:
    """A few short requests (first connections, the server's first steps)."""
    share = [(0.0, p, 8) for p in prompts]
    _event_loop_run(run_http(args, url, share, time.monotonic()))


def _event_loop_run(coro: Coroutine) -> object:
    """asyncio.run, on uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def arrivals(items: list[tuple[list[int], int]], rate: float, seed: int) -> list[float]:
    """Each request's send time in seconds from the start: Poisson arrivals at `rate` per
    second (seeded), or all at once (rate 0)."""
    rng, at, times = random.Random(seed + 1), 0.0, []
    for _ in items:
        times.append(at)
        at += rng.expovariate(rate) if rate else 0.0
    return times


def run_clients(
    pool: ProcessPoolExecutor,
    args: argparse.Namespace,
    url: str,
    items: list[tuple[list[int], int]],
    rate: float,
) -> tuple[list[dict], float, list[int]]:
    """The workload from args.client_procs processes of `pool` (requests dealt out in turn),
    one common start: the results in workload order, the wall time from the start to the
    last request's end, and the cores the processes ran on."""
    n = args.client_procs
    timed = list(zip(arrivals(items, rate, args.seed), *zip(*items)))
    list(pool.map(time.sleep, [0.2] * n))  # every process spawned and idle
    start_at = time.monotonic() + 0.2
    futures = [pool.submit(client_run, args, url, timed[k::n], start_at) for k in range(n)]
    done = [f.result() for f in futures]
    results = [None] * len(items)
    for k, (raw, _, _) in enumerate(done):
        results[k::n] = raw
    cores = sorted({c for _, _, used in done for c in used})
    return results, max(ended for _, ended, _ in done) - start_at, cores


def parse_cores(spec: str) -> set[int]:
    """'12-15' or '0,2,4-7' -> {cores}."""
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def client_pool(cores: set[int] | None, processes: int = 1) -> ProcessPoolExecutor:
    """Processes (spawned: no state of this one) for the HTTP client, pinned to `cores`."""
    return ProcessPoolExecutor(
        max_workers=processes,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=os.sched_setaffinity if cores else None,
        initargs=(0, cores) if cores else (),
    )
