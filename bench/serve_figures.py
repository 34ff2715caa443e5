"""bench/serve.py's figures of a run: a summary of its requests (TTFT, TPOT, ITL p50 / p99,
SSE events per token, the offered and achieved request rates), the median of rounds, and
their printing."""

from __future__ import annotations

import statistics

from tapserve.bench.serve_client import Result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _span_rate(times: list[float]) -> float:
    """Events per second from the first to the last of `times` (NaN for fewer than two, or
    all at once): applied to arrivals, the rate the Poisson draw offered; to the ends of the
    requests served, the rate the server achieved, free of the first request's latency and
    of the drain after the last arrival."""
    span = max(times) - min(times) if len(times) > 1 else 0.0
    return (len(times) - 1) / span if span > 0 else float("nan")


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.error is None]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    ms = 1000.0
    tokens = sum(r.output_tokens for r in ok)
    events = sum(r.token_events for r in ok)
    out = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "wall_s": wall,
        "output_tokens": tokens,
        "token_events": events,
        "sse_events_per_token": events / tokens if tokens else float("nan"),
        "output_tok_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "offered_requests_per_s": _span_rate([r.arrival for r in results]),
        "achieved_requests_per_s": _span_rate([r.ended for r in ok]),
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


def median_round(rounds: list[dict]) -> dict:
    """The round of median wall time (the upper one of an even count), with every round's
    wall time in "round_walls_s"."""
    walls = [r["wall_s"] for r in rounds]
    median = sorted(rounds, key=lambda r: r["wall_s"])[len(rounds) // 2]
    return {**median, "round_walls_s": walls} if len(rounds) > 1 else median


def print_summary(title: str, s: dict) -> None:
    print(f"\n== {title} ==")
    print(
        f"requests {s['requests']} (failed {s['failed']}), wall {s['wall_s']:.2f} s, "
        f"{s['output_tok_per_s']:.1f} output tok/s, {s['requests_per_s']:.2f} req/s"
    )
    if "round_walls_s" in s:
        walls = ", ".join(f"{w:.3f}" for w in s["round_walls_s"])
        print(f"  the median of {len(s['round_walls_s'])} rounds (walls {walls} s)")
    print(
        f"  output tokens streamed {s['output_tokens']}, in {s['token_events']} SSE events: "
        f"{s['sse_events_per_token']:.4f} events per token"
    )
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "latency_ms"):
        v = s[name]
        print(f"  {name:<11} mean {v['mean']:9.2f}  p50 {v['p50']:9.2f}  p99 {v['p99']:9.2f}")
    for e in s.get("errors", []):
        print("  error:", e)
