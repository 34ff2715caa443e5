"""The API process's relay capacity: the real api/server.py against a stand-in rank 0.

The stand-in speaks the real ZeroMQ wire protocol (api/wire.py): each request's accept, its
first token as a full RequestOutput, later tokens in the `Outputs` token columns (as rank 0
sends plain decode tokens) and its last as a finished RequestOutput. Once every request is
running it emits one `Outputs` per step with one token for each running request, either at
`--step-rate` steps/s or (0) as fast as the client takes them: a step goes out only while the
client has read all but `--window` steps' tokens. The client (a process of its own, a lean
HTTP/1.1 reader) streams `--concurrency` /v1/completions requests (token-id prompts,
ignore_eos) and checks every token's text against the stand-in's. Reports tokens/s relayed,
the API process's CPU time per token (/proc/<pid>/stat), SSE events per token, and whether the
API kept up with the step rate. The tokenizer is bench/serve.py's synthetic word-level one of
qwen3's vocabulary (what `--model-config` runs use).

    python bench/relay.py                    # as fast as the client reads
    python bench/relay.py --step-rate 80     # the H100 run's 80 steps/s x 256 tokens
    python bench/relay.py --tree /tmp/relay_before   # another checkout's API process
    python bench/relay.py --profile /tmp/api.prof    # cProfile the API process
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if not __package__:  # run as a script from a checkout: bind `tapserve` to it
    import runpy

    runpy.run_path(str(Path(__file__).resolve().parents[1] / "_checkout.py"))

import zmq  # noqa: E402

from tapserve.api import wire  # noqa: E402
from tapserve.api.config import ApiConfig  # noqa: E402
from tapserve.bench.serve_client import parse_cores  # noqa: E402
from tapserve.bench.serve_launch import synthetic_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def token_of(request: int, step: int, vocab: int) -> int:
    """The stand-in's token for client request `request` (its prompt's first id) at `step`."""
    return (request * 7919 + step * 104729 + 1) % vocab


# ---- the stand-in rank 0 -------------------------------------------------------------------
@dataclasses.dataclass
class Running:
    request: int  # the client's index (prompt[0])
    max_tokens: int
    sent: int = 0


class StandIn:
    """Rank 0's two sockets in a thread: accepts, then steps (see the module docstring)."""

    def __init__(self, ipc_dir: Path, args: argparse.Namespace, acked: multiprocessing.Value):
        self.ctx = zmq.Context()
        self.incoming = self.ctx.socket(zmq.PULL)
        self.incoming.bind(f"ipc://{ipc_dir}/{wire.TO_ENGINE}")
        self.outgoing = self.ctx.socket(zmq.PUSH)
        self.outgoing.bind(f"ipc://{ipc_dir}/{wire.FROM_ENGINE}")
        self.args, self.acked = args, acked
        self.running: dict[str, Running] = {}
        self.sent_tokens = 0
        self.steps = 0
        self.first_step: float | None = None
        self.adds: list[float] = []  # when each request reached rank 0
        self.late_s = 0.0  # the most a step went out behind its schedule (--step-rate)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        stats_at, started, next_step = 0.0, False, 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= stats_at:
                self.outgoing.send(wire.encode(wire.EngineStats(num_running=len(self.running))))
                stats_at = now + 0.5
            while self.incoming.poll(0):
                self._take(wire.decode(self.incoming.recv()))
            if not started:
                started = len(self.running) >= self.args.concurrency
                next_step = time.monotonic()
            if not (started and self.running):
                self.incoming.poll(1)
                continue
            if self.args.step_rate:
                wait = next_step - time.monotonic()
                if wait > 0.001:
                    self.incoming.poll(int(wait * 1000))
                    continue
                self.late_s = max(self.late_s, -wait)
                next_step += 1.0 / self.args.step_rate
            elif self.sent_tokens - self.acked.value > self.args.window * len(self.running):
                time.sleep(0.0002)
                continue
            self._step()

    def _take(self, message: object) -> None:
        if isinstance(message, wire.AddRequest):
            self.adds.append(time.monotonic())
            self.running[message.request_id] = Running(
                message.prompt_token_ids[0], message.sampling_params["max_new_tokens"]
            )
            accept = wire.RequestOutput(
                message.request_id, num_prompt_tokens=len(message.prompt_token_ids)
            )
            self.outgoing.send(wire.encode(wire.Outputs([accept])))
        elif isinstance(message, wire.AbortRequest):
            self.running.pop(message.request_id, None)

    def _step(self) -> None:
        outputs, rids, tokens = [], [], []
        for rid, r in list(self.running.items()):
            token = token_of(r.request, r.sent, self.args.vocab)
            r.sent += 1
            if r.sent == 1 or r.sent == r.max_tokens:
                done = r.sent == r.max_tokens
                seq = wire.SequenceOutput(0, [token], finish_reason="length" if done else None)
                outputs.append(wire.RequestOutput(rid, sequences=[seq], finished=done))
                if done:
                    del self.running[rid]
            else:
                rids.append(rid)
                tokens.append(token)
        self.outgoing.send(wire.encode(wire.Outputs(outputs, rids, tokens)))
        self.sent_tokens += len(outputs) + len(rids)
        self.steps += 1
        self.first_step = self.first_step or time.monotonic()

    def close(self) -> None:
        self.outgoing.send(wire.encode(wire.Shutdown("benchmark over", stopped=True)))
        self.stop.set()
        self.thread.join(5)
        self.ctx.destroy(0)


# ---- the client (a process of its own) -----------------------------------------------------
async def _stream(port: int, body: bytes, acked: multiprocessing.Value) -> tuple[str, int, int]:
    """One streamed request over a raw HTTP/1.1 connection: (text, tokens per usage, events
    that carried text)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200") or b"chunked" not in head.lower():
        raise RuntimeError(f"unexpected answer: {head[:200]!r} {await reader.read(300)!r}")
    texts, usage, events, raw, sse = [], 0, 0, b"", b""
    done = False
    while not done:
        data = await reader.read(1 << 16)
        if not data:
            raise RuntimeError("the stream ended before [DONE]")
        raw += data
        while True:  # chunked framing
            line_end = raw.find(b"\r\n")
            if line_end < 0:
                break
            size = int(raw[:line_end], 16)
            if len(raw) < line_end + 2 + size + 2:
                break
            sse += raw[line_end + 2 : line_end + 2 + size]
            raw = raw[line_end + 4 + size :]
        *complete, sse = sse.split(b"\n\n")
        tokens = 0
        for event in complete:
            if event == b"data: [DONE]":
                done = True
                continue
            chunk = json.loads(event[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if choice["text"]:
                    events += 1
                    tokens += choice["text"].count(" ")
                    texts.append(choice["text"])
        acked.value += tokens  # (one writer: this process)
    writer.close()
    return "".join(texts), usage, events


async def _client(port: int, args: argparse.Namespace, acked: multiprocessing.Value) -> dict:
    async def one(i: int) -> tuple[str, int, int]:
        body = {
            "model": "relay",
            "prompt": [i] + [1] * (args.prompt_len - 1),
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return await _stream(port, json.dumps(body).encode(), acked)

    results = await asyncio.gather(*(one(i) for i in range(args.concurrency)))
    end = time.monotonic()
    wrong = 0
    for i, (text, _, _) in enumerate(results):
        want = "".join(f"t{token_of(i, k, args.vocab)} " for k in range(args.max_tokens))
        wrong += text != want
    return {
        "end": end,
        "tokens": sum(r[1] for r in results),
        "events": sum(r[2] for r in results),
        "wrong_texts": wrong,
    }


def client_main(port: int, args: argparse.Namespace, acked, results) -> None:
    results.put(asyncio.run(_client(port, args, acked)))


# ---- the API process -----------------------------------------------------------------------
def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU time of a process (all its threads), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def serve_profiled(out: str, argv: list[str], tree: Path) -> None:
    """api/server.py of `tree` with `argv`, under cProfile (written to `out` at exit)."""
    import cProfile
    import runpy

    sys.argv = [str(tree / "api/server.py"), *argv]
    profile = cProfile.Profile(time.thread_time)  # CPU time: not the waits of a busy box
    profile.enable()
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        profile.disable()
        profile.dump_stats(out)


def wait_port(log: Path, proc: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"API listening on http://127\.0\.0\.1:(\d+)", log.read_text())
        if found:
            return int(found[1])
        if proc.poll() is not None:
            raise SystemExit(f"the API process exited:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    raise SystemExit("the API process did not start")


def run(args: argparse.Namespace) -> dict:
    tree = Path(args.tree).resolve()
    with tempfile.TemporaryDirectory(prefix="relay-") as tmp:
        work = Path(tmp)
        (work / "ipc").mkdir(mode=0o700)
        (work / "tok").mkdir()
        synthetic_tokenizer(args.vocab, work / "tok")
        ctx = multiprocessing.get_context("spawn")
        acked = ctx.RawValue("q", 0)
        rank0 = StandIn(work / "ipc", args, acked)
        config = ApiConfig(
            ipc_dir=str(work / "ipc"),
            tokenizer=str(work / "tok"),
            served_model_name="relay",
            port=0,
            max_model_len=args.prompt_len + args.max_tokens + 1,
            max_num_seqs=args.concurrency,
            parent_pid=os.getpid(),
            log_level="info",  # (its start-up line names the port)
        )
        if args.profile:
            command = [sys.executable, "-P", __file__, "--serve-profiled", args.profile, "--"]
        else:
            command = [sys.executable, "-P", str(tree / "api/server.py")]
        log = work / "api.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        api_cores = parse_cores(args.api_cores) if args.api_cores else None
        if api_cores:  # this process, the stand-in and the client (spawned after) elsewhere
            os.sched_setaffinity(0, (os.sched_getaffinity(0) - api_cores) or api_cores)
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [*command, *config.to_argv()],
                stdout=out,
                stderr=out,
                env={**env, "RELAY_TREE": str(tree)},
                preexec_fn=(lambda: os.sched_setaffinity(0, api_cores)) if api_cores else None,
            )
        try:
            port = wait_port(log, proc)
            results = ctx.Queue()
            client = ctx.Process(target=client_main, args=(port, args, acked, results))
            client.start()
            while rank0.first_step is None and client.is_alive():
                time.sleep(0.005)
            cpu_start = cpu_seconds(proc.pid)
            got = results.get(timeout=600)
            user, system = (b - a for a, b in zip(cpu_start, cpu_seconds(proc.pid)))
            client.join(30)
        finally:
            rank0.close()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    wall, cpu = got["end"] - rank0.first_step, user + system
    tokens = got["tokens"]
    return {
        "tokens": tokens,
        "wrong_texts": got["wrong_texts"],
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall),
        "steps_per_s": round(rank0.steps / wall, 1),
        "api_cpu_us_per_token": round(cpu / tokens * 1e6, 2),
        "api_cpu_us_per_event": round(cpu / max(1, got["events"]) * 1e6, 2),
        "api_cpu_share": round(cpu / wall, 3),  # cores' worth of CPU the API used
        "api_system_share": round(system / max(cpu, 1e-9), 3),  # of it, in the kernel
        "events_per_token": round(got["events"] / tokens, 4),
        "max_step_lateness_ms": round(rank0.late_s * 1e3, 2),
        # the API's time from the first request to reach rank 0 to the last (sent at once)
        "admission_ms": round((max(rank0.adds) - min(rank0.adds)) * 1e3, 1),
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-profiled":
        return serve_profiled(sys.argv[2], sys.argv[4:], Path(os.environ["RELAY_TREE"]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=500)
    parser.add_argument("--prompt-len", type=int, default=16, help="token ids a prompt")
    parser.add_argument("--step-rate", type=float, default=0.0, help="steps/s (0: closed loop)")
    parser.add_argument("--window", type=int, default=1, help="closed loop: steps unread")
    parser.add_argument("--vocab", type=int, default=151936, help="qwen3's vocabulary")
    parser.add_argument("--tree", default=str(ROOT), help="the checkout whose API runs")
    parser.add_argument("--profile", help="cProfile the API process into this file")
    parser.add_argument(
        "--api-cores", help="pin the API process to these cores (e.g. 1), the rest to the others"
    )
    args = parser.parse_args()
    result = run(args)
    if args.step_rate:
        result["kept_up"] = result["steps_per_s"] >= 0.98 * args.step_rate
    print(json.dumps({"args": vars(args), **result}))


if __name__ == "__main__":
    main()
