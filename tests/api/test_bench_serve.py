"""bench/serve.py: the nano-vllm workload as bench/offline.py makes it, a request-rate sweep
against a server it starts (the demo model on the CPU, a head on each request's last prompt
token, the client pinned to a core of its own), and its count of SSE events carrying tokens
against the tokens each event's logprobs list on a live server."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.helpers.api")
from tests.helpers.api import free_port, sse_events, sse_json  # noqa: E402

pytest_plugins = ["tests.helpers.api"]

ROOT = Path(__file__).resolve().parents[2]


def test_nano_vllm_workload_is_bench_offline_s():
    """The requests, token for token, and DESIGN.md's totals (142,827 in, 133,966 out)."""
    from tapserve.bench import offline, serve

    items = serve.workload(serve.parse_args(["--workload", "nano-vllm"]))
    prompts, params = offline.workload(256, 1024, 1024)
    assert [prompt for prompt, _ in items] == prompts
    assert [n for _, n in items] == [p.max_new_tokens for p in params]
    assert sum(len(prompt) for prompt, _ in items) == 142_827
    assert sum(n for _, n in items) == 133_966


def test_head_on_the_last_prompt_token_and_cores():
    from tapserve.bench import serve
    from tapserve.bench.serve_client import parse_cores, request_extras

    args = serve.parse_args(["--head", "last-prompt", "--extra-body", '{"top_p": 0.9}'])
    assert request_extras(args, [5, 6, 7]) == {
        "top_p": 0.9,
        "custom_output_params": {"position": 2},
    }
    assert request_extras(serve.parse_args([]), [5, 6, 7]) == {}
    assert parse_cores("12-15") == {12, 13, 14, 15}
    assert parse_cores("0,2,4-5") == {0, 2, 4, 5}


def test_rate_sweep_against_the_demo_model(tmp_path):
    """Two rates: a table row and a point per rate, the printed best rate the highest row
    within the targets, each rate's share of the requests (--sweep-seconds 0.5: 2 and 20),
    every token streamed, and the client on the core it was given."""
    client_core = max(os.sched_getaffinity(0))
    out = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/serve.py",
            "--launch",
            "--custom-module bench/last_token_head.py:LastTokenLinearHead --no-prefix-caching",
            "--port",
            str(free_port()),
            "--max-token-id",
            "1000",
            "--sweep-seconds",
            "0.5",
            "--input-len",
            "8",
            "--output-len",
            "5",
            "--warmup",
            "1",
            "--sweep-rates",
            "4,40",
            "--head",
            "last-prompt",
            "--client-cores",
            str(client_core),
            "--out-dir",
            str(out),
            "--no-progress",
        ],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "serve_sweep.png").stat().st_size > 1000
    table = (out / "serve_sweep.md").read_text()
    rows = [line for line in table.splitlines() if re.match(r"\| [\d.]+ \|", line)]
    assert [row.split("|")[1].strip() for row in rows] == ["4", "40"]
    held = [float(row.split("|")[1]) for row in rows if row.rstrip(" |").endswith("yes")]
    figures = json.loads((out / "serve_sweep.json").read_text())
    assert figures["best_rate"] == (max(held) if held else None)
    best = re.search(r"highest rate within .*: (\S+)", proc.stdout)[1]
    assert best == (f"{max(held):g}" if held else "none")
    assert [run["requests"] for run in figures["runs"]] == [2, 20]
    for run in figures["runs"]:
        assert run["failed"] == 0, run.get("errors")  # the head took every position
        assert run["output_tokens"] == run["expected_output_tokens"] == run["requests"] * 5
        assert run["offered_requests_per_s"] > 0 and run["achieved_requests_per_s"] > 0
        assert 0 < run["sse_events_per_token"] <= 1
        assert run["client_cores"] == [client_core]


def test_sweeps_repeat_prompts_so_need_prefix_caching_off():
    from tapserve.bench import serve

    with pytest.raises(SystemExit):
        serve.parse_args(["--launch", "", "--sweep-rates", "2,4"])
    args = serve.parse_args(
        ["--launch=--no-prefix-caching", "--sweep-rates", "2,8", "--sweep-seconds", "10"]
    )
    items = list(range(args.num_requests))
    assert len(items) == 80
    assert serve.requests_at(args, items, 2.0) == items[:20]
    assert serve.requests_at(args, items, 8.0) == items


def test_achieved_rate_is_measured_over_the_span_of_the_ends():
    """Requests that arrive 0.1 s apart and end 0.1 s apart were served at the offered rate,
    whatever their latency and the run's drain; ends 0.2 s apart are half of it."""
    from tapserve.bench.serve_client import Result
    from tapserve.bench.serve_figures import summarize
    from tapserve.bench.serve_report import Targets

    def run(gap: float) -> dict:
        results = [
            Result(ttft=0.05, latency=1.0, output_tokens=3, arrival=i / 10, ended=3 + i * gap)
            for i in range(11)
        ]
        return {"rate": 10.0, **summarize(results, wall=6.0)}

    kept, behind = run(0.1), run(0.2)
    assert kept["offered_requests_per_s"] == pytest.approx(10.0)
    assert kept["achieved_requests_per_s"] == pytest.approx(10.0)
    assert behind["achieved_requests_per_s"] == pytest.approx(5.0)
    assert kept["requests_per_s"] == pytest.approx(11 / 6.0)  # completed / wall: drain and all
    targets = Targets(ttft_p99_ms=1000, tpot_p99_ms=1e9)
    assert targets.held(kept) and not targets.held(behind)


def test_token_events_are_the_events_logprobs_give_tokens(http):
    """carries_tokens, told by each chunk's text and finish reason, against the tokens each
    chunk's logprobs list (which bench/serve.py does not ask for: they cost the server)."""
    from tapserve.bench.serve_client import carries_tokens

    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": [5, 17, 42, 99, 3],
        "max_tokens": 12,
        "ignore_eos": True,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = sse_json(sse_events(r))
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    assert choices
    for choice in choices:
        assert carries_tokens(choice) == bool(choice["logprobs"]["tokens"]), choice
    streamed = sum(len(choice["logprobs"]["tokens"]) for choice in choices)
    assert streamed == chunks[-1]["usage"]["completion_tokens"] == 12


def test_rounds_against_the_engine_in_process(tmp_path):
    """--rounds 2 --compare-engine from two client processes: both sides report their median
    round (every round's wall listed, the median one's wall reported), every token streamed
    and counted once, and the wall ratio."""
    figures_file = tmp_path / "figures.json"
    argv = ["--port", str(free_port()), "--max-token-id", "1000", "--num-requests", "3"]
    argv += ["--input-len", "6", "--output-len", "4", "--warmup", "1", "--concurrency", "3"]
    argv += [
        "--rounds",
        "2",
        "--compare-engine",
        "--json",
        str(figures_file),
        "--client-procs",
        "2",
    ]
    refused = subprocess.run(
        [sys.executable, "bench/serve.py", "--launch", "", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--no-prefix-caching" in refused.stderr
    proc = subprocess.run(
        [sys.executable, "bench/serve.py", "--launch=--no-prefix-caching", *argv],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(figures_file.read_text())
    for side in (figures["http"], figures["engine"]):
        assert len(side["round_walls_s"]) == 2
        assert side["wall_s"] == max(side["round_walls_s"])  # the upper median of two
        assert side["output_tokens"] == 3 * 4 and side["failed"] == 0
    assert figures["wall_ratio"] == figures["http"]["wall_s"] / figures["engine"]["wall_s"]
    assert "the median of 2 rounds" in proc.stdout
